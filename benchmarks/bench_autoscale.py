"""make bench-autoscale: how long the autoscaler's fleet takes to follow a step in load, up and
down, with nothing lost, on simulated engines (tests/support/autoscale.py's stack).

    python benchmarks/bench_autoscale.py [--runs 2] [--settings defaults|fast] [--low 0.3] [--high 3]

Each run: ``--low`` tasks/s for ``--low-s`` seconds, then a step to ``--high`` tasks/s held until
the replica count has stood still for ``--hold-s`` seconds (its count then is the one the step
called for), then no tasks until every task is done and the fleet is back at its floor. Per run:
the seconds from the step to the decision for the count the fleet settled on and to the first
moment it ran it (the replicas' start-up between the two), how often the count moved after that,
the seconds from the load's end to the floor, the tasks put and the audit (each task back as
exactly its samples, nothing dead-lettered). ``--settings defaults`` runs
rlmesh.control.autoscale's defaults (poll 5 s, rates over 30 s, up cool-down 15 s, down window
and cool-down 60 s); ``fast`` the integration test's short ones. Results go to
runs/bench-autoscale/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from tests.support.autoscale import AUTOSCALE_SPEC, DriveResult, FleetUnderLoad, Phase, autoscale_keys


def say(msg: str) -> None:
    print(f"[bench-autoscale] {msg}", flush=True)


def settings_keys(which: str, min_replicas: int, max_replicas: int) -> list[str]:
    if which == "fast":
        return autoscale_keys(min_replicas=min_replicas, max_replicas=max_replicas)
    section = "rlmesh.control.autoscale"
    return [
        f"{section}.enabled=true",
        f"{section}.min_replicas={min_replicas}",
        f"{section}.max_replicas={max_replicas}",
    ]


def follow(result: DriveResult, floor: int) -> dict[str, Any]:
    high = [s for s in result.samples if s.phase == "high"]
    settled_on = high[-1].replicas
    start = result.phase_start["high"]
    decided = next((s.t for s in high if s.desired is not None and s.desired >= settled_on), None)
    running = next((s.t for s in high if s.replicas >= settled_on and s.settled), None)
    # After reaching it: each change of the count running (a fall and a rise again at a load
    # between two counts, as the measured rate of a replica moves).
    after = [s.replicas for s in high if running is not None and s.t >= running and s.settled]
    moves = sum(1 for a, b in itertools.pairwise(after) if a != b)
    down = result.follow_s("none", lambda s: s.replicas == floor and s.settled)
    return {
        "settled_on": settled_on,
        "decided_s": None if decided is None else round(decided - start, 1),
        "up_s": None if running is None else round(running - start, 1),
        "moves_after": moves,
        "down_s": None if down is None else round(down, 1),
        "tasks": len(result.put),
        "audit": result.audit() or "ok",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--settings", choices=("defaults", "fast"), default="defaults")
    p.add_argument("--low", type=float, default=0.3, help="tasks/s before the step")
    p.add_argument("--high", type=float, default=3.0, help="tasks/s after it")
    p.add_argument("--low-s", type=float, default=30.0)
    p.add_argument("--hold-s", type=float, default=30.0, help="the count must stand still this long")
    p.add_argument("--max-replicas", type=int, default=6)
    p.add_argument("--workdir", default="runs/bench-autoscale")
    args = p.parse_args(argv)
    out = Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in range(args.runs):
        say(
            f"run {run + 1} of {args.runs}: {args.low:g} -> {args.high:g} -> 0 tasks/s, {args.settings} settings"
        )
        with tempfile.TemporaryDirectory(dir=out) as root:
            fleet = FleetUnderLoad(
                Path(root),
                AUTOSCALE_SPEC,
                min_replicas=1,
                max_replicas=args.max_replicas,
                settings=settings_keys(args.settings, 1, args.max_replicas),
                say=say,
            )
            t0 = time.monotonic()
            with fleet:
                result = fleet.drive(
                    [
                        Phase("low", args.low, seconds=args.low_s),
                        Phase(
                            "high",
                            args.high,
                            until=lambda s: s.replicas > 1 and s.replicas == s.desired and s.settled,
                            what="the fleet standing still above one replica",
                            deadline_s=600,
                            hold_s=args.hold_s,
                        ),
                        Phase(
                            "none",
                            0.0,
                            until=lambda s: s.outstanding == 0 and s.replicas == 1 and s.settled,
                            what="every task done and the fleet back at one replica",
                            deadline_s=600,
                        ),
                    ]
                )
            row = {"run": run, **follow(result, 1), "wall_s": round(time.monotonic() - t0, 1)}
        say(json.dumps(row))
        rows.append(row)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    print()
    print(
        "| run | settled on | step -> count decided (s) | step -> count running (s) | changes after | "
        "load end -> floor (s) | tasks | audit |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        audit = r["audit"] if r["audit"] == "ok" else f"{len(r['audit'])} problems"
        print(
            f"| {r['run']} | {r['settled_on']} | {r['decided_s']} | {r['up_s']} | {r['moves_after']} | "
            f"{r['down_s']} | {r['tasks']} | {audit} |"
        )
    bad = [r for r in rows if r["audit"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
