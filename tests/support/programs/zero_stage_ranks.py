"""Run by torchrun with 2 ranks: one PPO step of learner.ZERO_CASE at each ZeRO stage given, with
a checkpoint round trip; rank 0 saves {stage: run_zero_case(...)} to --out."""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

from tests.support.learner import run_uneven_case, run_zero_case


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--checkpoints", required=True, help="a directory shared by the ranks")
    args = parser.parse_args()
    results = {}
    for stage in (int(s) for s in args.stages.split(",")):
        results[stage] = run_zero_case(args.model, stage, os.path.join(args.checkpoints, f"zero{stage}"))
        print(f"rank {os.environ['RANK']}: stage {stage} done", flush=True)
        gc.collect()
    results["uneven"] = run_uneven_case(args.model, 3)
    if os.environ["RANK"] == "0":
        torch.save(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
