"""make demo-seeds: `rlmesh demo --seed N` for seeds 0, 1, 2, one after the other, then the table
docs/quickstart.md shows (start, end, lift, PPO wall time, warm-up). Each run prints its own progress.

    python benchmarks/demo_seeds.py [--seeds 0 1 2] [--workdir runs/demo] [demo args...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TARGET_LIFT = 0.30
TARGET_WALL_S = 600


def run_seed(seed: int, workdir: str, extra: list[str]) -> dict:
    argv = [sys.executable, "-m", "rlmesh.cli", "demo", "--seed", str(seed), "--workdir", workdir, *extra]
    print(f"$ {' '.join(argv[2:])}", flush=True)
    lines: list[str] = []
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    ) as p:
        assert p.stdout is not None
        for line in p.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    if p.returncode != 0 or not lines:
        return {"seed": seed, "failed": p.returncode}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workdir", default="runs/demo")
    args, extra = parser.parse_known_args()
    results = [run_seed(seed, args.workdir, extra) for seed in args.seeds]
    print()
    print("| seed | start | end | lift | PPO wall time | warm-up |")
    print("|---|---|---|---|---|---|")
    ok = True
    for r in results:
        if "failed" in r:
            print(f"| {r['seed']} | failed (exit code {r['failed']}) | | | | |")
            ok = False
            continue
        lift = r["acc_after"] - r["acc_before"]
        warmup = "cached" if r["warmup_cached"] else f"{r['warmup_s']:.0f} s"
        print(
            f"| {r['seed']} | {r['acc_before']:.1%} | {r['acc_after']:.1%} | {lift * 100:+.1f} points "
            f"| {r['wall_s']:.0f} s | {warmup} (dev {r['warmup_dev_score']:.1%}) |"
        )
        ok = ok and lift >= TARGET_LIFT and r["wall_s"] <= TARGET_WALL_S
    print(
        f"\ntarget: >= +{TARGET_LIFT * 100:.0f} points within {TARGET_WALL_S} s for every seed: {'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
