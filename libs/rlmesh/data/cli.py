"""``rlmesh data ...``: write task datasets in verl's Parquet layout."""

from __future__ import annotations

import argparse
import sys

from rlmesh.data.arithmetic import ARITHMETIC_INSTRUCTION, OPS, generate_arithmetic
from rlmesh.data.chain import CHAIN_INSTRUCTION, generate_chain, response_lengths
from rlmesh.data.dataset import read_parquet
from rlmesh.data.errors import DatasetError
from rlmesh.data.gsm8k import convert_gsm8k


def cmd_arithmetic(args: argparse.Namespace) -> int:
    paths = generate_arithmetic(
        args.out,
        args.seed,
        train_size=args.train_size,
        val_size=args.val_size,
        min_terms=args.min_terms,
        max_terms=args.max_terms,
        max_operand=args.max_operand,
        ops=args.ops,
    )
    for split, path in paths.items():
        print(f"wrote {path} ({read_parquet(path).num_rows} {split} rows)")
    return 0


def cmd_chain(args: argparse.Namespace) -> int:
    paths = generate_chain(
        args.out,
        args.seed,
        train_size=args.train_size,
        val_size=args.val_size,
        max_steps=args.max_steps,
        tail=args.tail,
        max_start=args.max_start,
        max_delta=args.max_delta,
    )
    for split, path in paths.items():
        rows = read_parquet(path).to_pylist()
        n = response_lengths(rows)
        print(
            f"wrote {path} ({len(rows)} {split} rows); correct response length in characters: min {n['min']}, "
            f"p50 {n['p50']}, p90 {n['p90']}, p99 {n['p99']}, max {n['max']} ({n['max_over_p50']:.1f}x the median)"
        )
    return 0


def cmd_gsm8k(args: argparse.Namespace) -> int:
    path, n = convert_gsm8k(args.input, args.out, split=args.split)
    print(f"wrote {path} ({n} {args.split} rows)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlmesh data", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="{arithmetic,chain,gsm8k}")

    a = sub.add_parser(
        "arithmetic",
        help="synthetic integer arithmetic (the CPU demo task)",
        description=f'Prompts "What is 12+7*3? {ARITHMETIC_INSTRUCTION}", answer "#### 33". '
        "Writes OUT/train.parquet and OUT/test.parquet (disjoint expressions).",
    )
    a.add_argument("--out", required=True, help="output directory")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--train-size", type=int, default=2000)
    a.add_argument("--val-size", type=int, default=200)
    a.add_argument("--min-terms", type=int, default=2)
    a.add_argument("--max-terms", type=int, default=3)
    a.add_argument("--max-operand", type=int, default=20, help="operands are drawn from 0..max-operand")
    a.add_argument("--ops", default=OPS, help=f"operators to use, a subset of {OPS!r}")
    a.set_defaults(func=cmd_arithmetic)

    c = sub.add_parser(
        "chain",
        help="running totals with a long tail of response lengths (data_source chain)",
        description=f'Prompts "Start at 7, then +3 -5 +2. {CHAIN_INSTRUCTION}", answer "10 5 7 #### 7" '
        "(extra_info.solution; the ground truth is the last total). The number of steps k is drawn with "
        "P(k) ~ k^-tail, so most responses are short and a few run to max-steps totals. Writes "
        "OUT/train.parquet and OUT/test.parquet and prints the length distribution of each.",
    )
    c.add_argument("--out", required=True, help="output directory")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--train-size", type=int, default=2000)
    c.add_argument("--val-size", type=int, default=200)
    c.add_argument("--max-steps", type=int, default=40)
    c.add_argument("--tail", type=float, default=1.3, help="P(k steps) ~ k^-tail; 0 = uniform")
    c.add_argument("--max-start", type=int, default=20, help="the start is drawn from 0..max-start")
    c.add_argument("--max-delta", type=int, default=9, help="each step adds ±1..max-delta")
    c.set_defaults(func=cmd_chain)

    g = sub.add_parser(
        "gsm8k",
        help="convert GSM8K jsonl/parquet (question, answer) to verl's layout",
        description="Converts a local GSM8K file exactly as verl's examples/data_preprocess/gsm8k.py; "
        "writes OUT/<split>.parquet.",
    )
    g.add_argument("--input", required=True, help="GSM8K .jsonl or .parquet with question and answer")
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--split", default="train", choices=["train", "test"])
    g.set_defaults(func=cmd_gsm8k)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except SystemExit as e:  # --help and usage errors: hand back the code, not an exception
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except (DatasetError, ValueError) as e:
        print(f"rlmesh data: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
