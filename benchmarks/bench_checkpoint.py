"""make bench-checkpoint: what a checkpoint every step (``trainer.save_freq=1``) costs the demo's step.

Runs the demo's job (``rlmesh demo``, its model and data, validation off) three times per seed,
one after the other: without checkpoints, with one every step written in the background
(``rlmesh.learner.async_checkpoint``, the default), and with one every step written in the step.
For each run it prints, from the learner's metrics rows (steps 3.. : the first ones warm up):

- the median step time;
- what the checkpoint cost the step (``timing_s/save_checkpoint``: the snapshot into host memory
  in the background mode, the whole write otherwise), as a share of the same run's step time;
- how long a background write took (``checkpoint/write_s``), and one checkpoint's size on disk.

    python benchmarks/bench_checkpoint.py [--seeds 0 1] [--steps 30] [--workdir runs/bench-checkpoint]

Not a test: the times are read, not asserted (run it on an idle machine). The snapshot's cost
grows with the checkpoint's bytes (weights, optimizer states, for the actor and the critic), so
seconds per GB, printed, is what carries over to a larger model on the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MODES = {
    "no checkpoints": ["trainer.save_freq=-1"],
    "save_freq=1, background": ["trainer.save_freq=1", "rlmesh.learner.async_checkpoint=true"],
    "save_freq=1, in the step": ["trainer.save_freq=1", "rlmesh.learner.async_checkpoint=false"],
}


def run(workdir: Path, seed: int, steps: int, keys: list[str]) -> Path:
    """One demo job; returns its checkpoint directory (where metrics.jsonl is)."""
    argv = [sys.executable, "-m", "rlmesh.cli", "demo", "--workdir", str(workdir), "--seed", str(seed)]
    argv += ["--steps", str(steps), "--test-freq", "-1", "trainer.val_before_train=false", *keys]
    print(f"[bench-checkpoint] {' '.join(argv[3:])}", flush=True)
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"the job failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    return Path(summary["checkpoint_dir"])


def measure(checkpoint_dir: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (checkpoint_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing_s/step" in r and r["step"] >= 3]
    saved = [r for r in steps if r.get("timing_s/save_checkpoint", 0) > 0]
    sizes = [
        sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        for d in checkpoint_dir.glob("global_step_*")
    ]
    return {
        "step_s": statistics.median(r["timing_s/step"] for r in steps),
        "save_s": statistics.mean(r["timing_s/save_checkpoint"] for r in saved) if saved else 0.0,
        "write_s": statistics.mean(r["checkpoint/write_s"] for r in saved if r["checkpoint/write_s"] > 0)
        if any(r.get("checkpoint/write_s", 0) > 0 for r in saved)
        else 0.0,
        "size_mb": max(sizes, default=0) / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workdir", default="runs/bench-checkpoint")
    args = p.parse_args()
    workdir = Path(args.workdir)
    print(
        f"{'seed':>4}  {'mode':<26} {'step s':>7} {'ckpt s':>7} {'share':>6} {'write s':>7} {'MB':>6} {'s/GB':>6}"
    )
    for seed in args.seeds:
        for mode, keys in MODES.items():
            m = measure(run(workdir, seed, args.steps, keys))  # the warm-up is made once, then reused
            share = m["save_s"] / m["step_s"]
            per_gb = m["save_s"] / (m["size_mb"] / 1024) if m["size_mb"] else 0.0
            print(
                f"{seed:>4}  {mode:<26} {m['step_s']:7.3f} {m['save_s']:7.3f} {share:6.1%} "
                f"{m['write_s']:7.3f} {m['size_mb']:6.1f} {per_gb:6.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
