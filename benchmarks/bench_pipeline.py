"""make bench: the demo's pipeline at a fixed configuration; per-stage throughput and the
orchestration overhead.

Runs 20 PPO steps of the CPU demo (prepared model and data reused from `rlmesh demo`'s cache)
and reports, from the services' own timings:

- per-stage throughput: generated tokens/s, learner forward and update tokens/s, push time;
- orchestration overhead: the share of the steady steps' wall time (from the start of step 2 to
  the end of the last step; step 1 warms up) during which no process did model compute. Model
  compute is the union of the wall-clock intervals during which
    - the learner computed old log-probs, values, critic and actor updates, or pushed weights
      (``timing_start/<phase>`` + ``timing_s/<phase>`` of its metrics rows),
    - any engine ran forwards (``busy_intervals`` of its ``/get_server_info``),
    - the reference ran forwards (``busy_intervals`` of its GetInfo);
  work that runs at the same time counts once (engines generate and the reference scores
  concurrently). Target: <= 10%;
- what the rest of the wall time was: waiting for rollouts while nothing computed (queue
  hand-offs, reward scoring, RPCs), the learner's advantage computation, and the learner's
  bookkeeping (building the batch, metrics, committing, logging, between steps).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import grpc

from rlmesh.job import demo
from rlmesh.job.report import engine_server_info, read_metrics
from rlmesh.job.train import run_job, say_with
from rlmesh.runtime.busy import Interval, union_seconds
from rlmesh.v1 import common_pb2, reference_pb2_grpc

STEPS = 20
TARGET = 0.10
# The learner's model compute, each timed by the trainer or the loop (timing_s/ + timing_start/).
LEARNER_COMPUTE = ("old_log_prob", "values", "update_critic", "update_actor", "push_weights")


def engine_info(rollout_address: str) -> dict[str, Any]:
    info = engine_server_info(rollout_address)
    if "busy_intervals" not in info:
        raise SystemExit(f"the engine of {rollout_address} reports no busy_intervals in /get_server_info")
    return {
        "busy_s": float(info["busy_s"]),
        "intervals": [(float(a), float(b)) for a, b in info["busy_intervals"]],
    }


def reference_info(address: str) -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        info = reference_pb2_grpc.ReferenceStub(channel).GetInfo(common_pb2.Empty(), timeout=30)
    flat = list(info.busy_intervals)
    return {"busy_s": info.busy_s, "intervals": list(zip(flat[::2], flat[1::2], strict=True))}


def phase(row: dict[str, float], name: str) -> Interval:
    """The wall-clock interval of one timed phase of a metrics row."""
    if f"timing_start/{name}" not in row:
        raise SystemExit(
            f"step {row['step']:.0f}'s metrics have timing_s/{name} but no timing_start/{name}: the "
            "learner does not record when its phases begin"
        )
    start = row[f"timing_start/{name}"]
    return start, start + row[f"timing_s/{name}"]


def phases(rows: list[dict[str, float]], names: tuple[str, ...]) -> list[Interval]:
    return [phase(r, name) for r in rows for name in names if f"timing_s/{name}" in r]


def main() -> int:
    args = demo.build_parser().parse_args(
        ["--steps", str(STEPS), "--test-freq", "-1", "trainer.val_before_train=false", "trainer.save_freq=-1"]
    )
    prepared = demo.prepare_from_args(args)
    run_id = f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.workdir) / run_id
    overrides = demo.run_overrides(args, prepared, run_dir, run_id)
    services: dict[str, dict[str, Any]] = {}

    def read_services(stack: Any) -> None:
        for i, replica in enumerate(stack.rollouts):
            services[f"engine {i}"] = engine_info(replica.grpc_address)
        services["reference"] = reference_info(stack.get("reference").grpc_address)

    result = run_job(
        args.config, overrides, service_dir=run_dir, say=say_with("bench"), before_stop=read_services
    )
    if result.code != 0:
        print(f"the run failed: {result.failure}")
        return result.code
    rows = [r for r in read_metrics(run_dir / "checkpoints" / "metrics.jsonl") if "timing_s/step" in r]
    # The first step includes warm-up (first forwards, group set-up): leave it out.
    steady = rows[1:] or rows

    def total(key: str, rs: list = steady) -> float:
        return sum(r.get(key, 0.0) for r in rs)

    start, end = phase(steady[0], "step")[0], phase(steady[-1], "step")[1]
    wall = end - start
    learner = phases(rows, LEARNER_COMPUTE)
    engines = {name: s["intervals"] for name, s in services.items() if name.startswith("engine")}
    reference = services["reference"]["intervals"]
    rollout_side = [*engines.values(), reference]
    everything = [learner, *rollout_side]
    for name, s in services.items():
        # Trackers keep their most recent intervals only: older ones dropped would undercount.
        if union_seconds([s["intervals"]], float("-inf"), float("inf")) < s["busy_s"] - 0.01:
            print(f"  warning: {name}'s busy intervals do not cover its busy_s: some were dropped")
    compute = union_seconds(everything, start, end)
    overhead = max(0.0, 1 - compute / wall)

    def idle_during(intervals: list[Interval]) -> float:
        """Seconds of ``intervals`` within the span during which nothing computed."""
        return union_seconds([intervals, *everything], start, end) - compute

    waiting = idle_during(phases(rows, ("gen",)))
    advantages = idle_during(phases(rows, ("adv",)))
    bookkeeping = wall - compute - waiting - advantages

    print()
    print(f"  pipeline benchmark: {len(rows)} PPO steps; steps 2-{len(rows)} span {wall:.1f} s of wall time")
    print(
        f"  generated tokens/s (learner's wait)   {total('training/response_tokens') / total('timing_s/gen'):9.0f}"
    )
    engine_busy = sum(s["busy_s"] for name, s in services.items() if name.startswith("engine"))
    print(
        f"  engine tokens/s while busy (all)      {total('training/response_tokens', rows) / max(engine_busy, 1e-9):9.0f}"
    )
    print(
        f"  learner forward tokens/s              {total('training/tokens') / max(total('timing_s/old_log_prob') + total('timing_s/values'), 1e-9):9.0f}"
    )
    print(
        f"  learner update tokens/s               {total('training/tokens') / max(total('timing_s/update_actor') + total('timing_s/update_critic'), 1e-9):9.0f}"
    )
    print(f"  weight push, mean seconds             {total('timing_s/push_weights') / len(steady):9.3f}")

    def share(seconds: float) -> str:
        return f"{seconds:7.1f} s {seconds / wall:6.1%}"

    print("  model compute within the span (each part, then their union):")
    print(f"    learner (forwards, updates, push)   {share(union_seconds([learner], start, end))}")
    for name, intervals in engines.items():
        print(f"    {name + ' forwards':<36}{share(union_seconds([intervals], start, end))}")
    print(f"    reference forwards                  {share(union_seconds([reference], start, end))}")
    rollout = union_seconds(rollout_side, start, end)
    print(f"    rollout side (engines + reference)  {share(rollout)}")
    overlap = union_seconds([learner], start, end) + rollout - compute
    print(f"    learner while the rollout side ran  {share(overlap)}")
    print(f"    all model compute (union)           {share(compute)}")
    print("  the rest, where nothing computed:")
    print(f"    waiting for rollouts                {share(waiting)}   (queues, reward scoring, RPCs)")
    print(f"    learner advantages                  {share(advantages)}")
    print(f"    learner bookkeeping, between steps  {share(bookkeeping)}   (batch, metrics, commit, logging)")
    print(
        f"  orchestration overhead                {overhead:9.1%}   "
        f"(target <= {TARGET:.0%}: {'met' if overhead <= TARGET else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
