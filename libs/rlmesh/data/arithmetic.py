"""A synthetic, exactly verifiable task for the CPU demo: multi-term integer arithmetic.

docs/train.md#rlmesh-data"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from rlmesh.data.layout import distinct_splits, verl_row, write_rows

ARITHMETIC_DATA_SOURCE = "arithmetic"
ARITHMETIC_INSTRUCTION = 'Answer after "####".'
OPS = "+-*"


def evaluate_expression(expression: str) -> int:
    """The exact integer value of ``a op b op c ...`` with op in + - * (no parentheses)."""
    tokens = re.findall(r"\d+|[-+*]", expression)
    if "".join(tokens) != expression or len(tokens) % 2 == 0 or not tokens[0].isdigit():
        raise ValueError(f"not an expression of non-negative integers and + - *: {expression!r}")
    # A sum of signed products: "*" extends the current product, "+"/"-" start a new one.
    total, sign, product = 0, 1, int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2], strict=True):
        if op == "*":
            product *= int(num)
        else:
            total += sign * product
            sign, product = (1 if op == "+" else -1), int(num)
    return total + sign * product


def count_expressions(min_terms: int, max_terms: int, max_operand: int, ops: str) -> int:
    """How many distinct expressions the knobs allow (the most rows one can ask for)."""
    return sum((max_operand + 1) ** k * len(ops) ** (k - 1) for k in range(min_terms, max_terms + 1))


def sample_expression(rng: random.Random, min_terms: int, max_terms: int, max_operand: int, ops: str) -> str:
    n = rng.randint(min_terms, max_terms)
    parts = [str(rng.randint(0, max_operand))]
    for _ in range(n - 1):
        parts += [rng.choice(ops), str(rng.randint(0, max_operand))]
    return "".join(parts)


def arithmetic_prompt(expression: str) -> str:
    return f"What is {expression}? {ARITHMETIC_INSTRUCTION}"


def format_arithmetic_solution(ground_truth: int | str) -> str:
    """The target response for a supervised warm-up, e.g. ``#### 16`` (append the tokenizer's eos)."""
    return f"#### {ground_truth}"


def arithmetic_row(expression: str, split: str, index: int) -> dict[str, Any]:
    """One verl-layout row for an expression."""
    answer = evaluate_expression(expression)
    extra = {"split": split, "index": index, "expression": expression}
    return verl_row(ARITHMETIC_DATA_SOURCE, arithmetic_prompt(expression), str(answer), extra)


def make_arithmetic_rows(
    seed: int,
    *,
    train_size: int = 2000,
    val_size: int = 200,
    min_terms: int = 2,
    max_terms: int = 3,
    max_operand: int = 20,
    ops: str = OPS,
    dev_size: int = 0,
) -> dict[str, list[dict[str, Any]]]:
    """{"train": rows, "test": rows} (and "dev": rows when dev_size > 0): distinct expressions,
    none in two splits."""
    if not 2 <= min_terms <= max_terms:
        raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"ops must be a non-empty subset of {OPS!r}, got {ops!r}")
    if train_size < 1 or val_size < 1 or dev_size < 0:
        raise ValueError(
            f"train_size and val_size must be >= 1 and dev_size >= 0, got {train_size}, {val_size}, {dev_size}"
        )
    ops = "".join(sorted(set(ops), key=OPS.index))  # "*+" and "+*" are the same knob: same draws
    total = train_size + val_size + dev_size
    space = count_expressions(min_terms, max_terms, max_operand, ops)
    if total > space:
        raise ValueError(f"asked for {total} distinct expressions but these knobs allow only {space}")

    rng = random.Random(seed)
    splits = distinct_splits(
        lambda: sample_expression(rng, min_terms, max_terms, max_operand, ops),
        train_size=train_size,
        val_size=val_size,
        dev_size=dev_size,
        too_few=f"could not draw {total} distinct expressions out of {space}; widen the knobs",
    )
    return {
        split: [arithmetic_row(e, split, i) for i, e in enumerate(exprs)]
        for split, exprs in splits.items()
        if exprs
    }


def generate_arithmetic(
    out_dir: str | Path,
    seed: int,
    *,
    train_size: int = 2000,
    val_size: int = 200,
    min_terms: int = 2,
    max_terms: int = 3,
    max_operand: int = 20,
    ops: str = OPS,
    dev_size: int = 0,
) -> dict[str, Path]:
    """Write out_dir/train.parquet and out_dir/test.parquet (and dev.parquet when dev_size > 0);
    returns {"train": path, "test": path[, "dev": path]}."""
    rows = make_arithmetic_rows(
        seed,
        train_size=train_size,
        val_size=val_size,
        min_terms=min_terms,
        max_terms=max_terms,
        max_operand=max_operand,
        ops=ops,
        dev_size=dev_size,
    )
    out = Path(out_dir)
    return {split: write_rows(r, out / f"{split}.parquet") for split, r in rows.items()}
