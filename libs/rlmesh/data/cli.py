"""``rlmesh data ...``: write task datasets in verl's Parquet layout."""

from __future__ import annotations

import argparse
import sys

from rlmesh.data.arithmetic import ARITHMETIC_INSTRUCTION, OPS, generate_arithmetic
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


def cmd_gsm8k(args: argparse.Namespace) -> int:
    path, n = convert_gsm8k(args.input, args.out, split=args.split)
    print(f"wrote {path} ({n} {args.split} rows)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlmesh data", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="{arithmetic,gsm8k}")

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
