"""A long-tail task: running totals, whose correct response is the chain of intermediate results, so
its length varies tenfold between the median and the tail. docs/train.md#rlmesh-data"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlmesh.data.layout import distinct_splits, verl_row, write_rows

CHAIN_DATA_SOURCE = "chain"
CHAIN_INSTRUCTION = 'Write each running total, then the last after "####".'


def step_weights(max_steps: int, tail: float) -> list[float]:
    """P(k steps) ∝ k^-tail for k = 1..max_steps: most chains are short, a few run to max_steps."""
    return [k**-tail for k in range(1, max_steps + 1)]


def chain_totals(start: int, deltas: Sequence[int]) -> list[int]:
    """The running totals after each delta (as many as there are deltas)."""
    totals, value = [], start
    for d in deltas:
        value += d
        totals.append(value)
    return totals


def chain_prompt(start: int, deltas: Sequence[int]) -> str:
    return f"Start at {start}, then {' '.join(f'{d:+d}' for d in deltas)}. {CHAIN_INSTRUCTION}"


def format_chain_solution(totals: Sequence[int]) -> str:
    """The correct response, e.g. ``12 9 17 #### 17`` (append the tokenizer's eos to train on it)."""
    return f"{' '.join(map(str, totals))} #### {totals[-1]}"


def chain_row(start: int, deltas: Sequence[int], split: str, index: int) -> dict[str, Any]:
    """One verl-layout row: the last total is the ground truth (the arithmetic rule reward scores
    it); ``extra_info.solution`` holds the whole chain, the target of a supervised warm-up."""
    totals = chain_totals(start, deltas)
    solution = format_chain_solution(totals)
    extra = {"split": split, "index": index, "steps": len(deltas), "solution": solution}
    return verl_row(CHAIN_DATA_SOURCE, chain_prompt(start, deltas), str(totals[-1]), extra)


def make_chain_rows(
    seed: int,
    *,
    train_size: int = 2000,
    val_size: int = 200,
    dev_size: int = 0,
    max_steps: int = 40,
    tail: float = 1.3,
    max_start: int = 20,
    max_delta: int = 9,
) -> dict[str, list[dict[str, Any]]]:
    """{"train": rows, "test": rows} (and "dev" when dev_size > 0): distinct prompts, none in two
    splits, each of 1..max_steps deltas in ±1..max_delta drawn with ``step_weights``."""
    if max_steps < 1 or tail < 0 or max_start < 0 or max_delta < 1:
        raise ValueError(
            f"need max_steps >= 1, tail >= 0, max_start >= 0 and max_delta >= 1, got {max_steps}, {tail}, "
            f"{max_start}, {max_delta}"
        )
    if train_size < 1 or val_size < 1 or dev_size < 0:
        raise ValueError(
            f"train_size and val_size must be >= 1 and dev_size >= 0, got {train_size}, {val_size}, {dev_size}"
        )
    rng = random.Random(seed)
    weights = step_weights(max_steps, tail)
    deltas = [d for d in range(-max_delta, max_delta + 1) if d != 0]

    def draw() -> tuple[int, ...]:
        steps = rng.choices(range(1, max_steps + 1), weights)[0]
        return (rng.randint(0, max_start), *(rng.choice(deltas) for _ in range(steps)))

    splits = distinct_splits(
        draw,
        train_size=train_size,
        val_size=val_size,
        dev_size=dev_size,
        too_few=f"could not draw {train_size + val_size + dev_size} distinct chains; raise max_steps, "
        "max_start or max_delta",
    )
    return {
        split: [chain_row(c[0], c[1:], split, i) for i, c in enumerate(chains)]
        for split, chains in splits.items()
        if chains
    }


def response_lengths(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Characters of each row's correct response (tokens under the demo's character tokenizer):
    min, p50, p90, p99, max, and max over p50."""
    lengths = sorted(len(r["extra_info"]["solution"]) for r in rows)
    if not lengths:
        raise ValueError("no rows")

    def pct(q: float) -> int:
        return lengths[min(len(lengths) - 1, int(q * len(lengths)))]

    return {
        "min": lengths[0],
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": lengths[-1],
        "max_over_p50": lengths[-1] / pct(0.5),
    }


def generate_chain(out_dir: str | Path, seed: int, **knobs: Any) -> dict[str, Path]:
    """Write out_dir/{train,test[,dev]}.parquet (``make_chain_rows``'s knobs); returns their paths."""
    rows = make_chain_rows(seed, **knobs)
    out = Path(out_dir)
    return {split: write_rows(r, out / f"{split}.parquet") for split, r in rows.items()}
