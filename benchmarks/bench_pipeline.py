"""make bench: the demo's pipeline at a fixed configuration; per-stage throughput and the
orchestration overhead.

Runs 20 PPO steps of the CPU demo (prepared model and data reused from `rlmesh demo`'s cache)
and reports, from the services' own timings:

- per-stage throughput: generated tokens/s, learner forward and update tokens/s, push time;
- orchestration overhead: the share of step wall time not spent in model compute, where model
  compute = the learner's forwards, updates and weight push (its timing_s/*) + the busiest
  engine's forward time (each engine's busy_s). The reference's time is not counted (its timer
  runs per call and calls overlap), so the figure is an upper bound. Target: <= 10%.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import grpc

from rlmesh import demo
from rlmesh.runtime.health import scrape_metrics
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import common_pb2, rollout_pb2_grpc

STEPS = 20


def engine_busy_s(rollout_address: str) -> float:
    with grpc.insecure_channel(rollout_address) as channel:
        url = rollout_pb2_grpc.RolloutStub(channel).GetInfo(common_pb2.Empty(), timeout=10).engine_url
    with urllib.request.urlopen(url + "/get_server_info", timeout=10) as resp:
        return float(json.loads(resp.read())["busy_s"])


def reference_compute_s(port: int) -> float:
    for line in scrape_metrics("127.0.0.1", port).splitlines():
        if line.startswith("rlmesh_reference_compute_seconds_sum"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> int:
    args = demo.build_parser().parse_args(
        ["--steps", str(STEPS), "--test-freq", "-1", "trainer.val_before_train=false", "trainer.save_freq=-1"]
    )
    prepared = demo.prepare_from_args(args)
    run_id = f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.workdir) / run_id
    overrides = demo.run_overrides(args, prepared, run_dir, run_id)
    counters: dict[str, float] = {}

    def read_counters(endpoints: dict) -> None:
        counters["engine_busy_max_s"] = max(engine_busy_s(a) for a in endpoints["rollouts"])
        counters["engine_busy_sum_s"] = sum(engine_busy_s(a) for a in endpoints["rollouts"])
        counters["reference_s"] = reference_compute_s(endpoints["reference_metrics_port"])

    with ProcessLauncher(run_dir, stop_grace_s=30) as launcher:
        code = demo.train(launcher, args, overrides, run_dir, before_stop=read_counters)
    if code != 0:
        print(f"the learner failed with exit code {code}; see {run_dir / 'logs'}")
        return code
    rows = [r for r in demo.read_metrics(run_dir / "checkpoints" / "metrics.jsonl") if "timing_s/step" in r]
    # The first step includes warm-up (first forwards, group set-up): leave it out of the rates.
    steady = rows[1:] or rows

    def total(key: str, rs: list = steady) -> float:
        return sum(r.get(key, 0.0) for r in rs)

    wall = total("timing_s/step", rows)
    learner = sum(
        total(k, rows)
        for k in (
            "timing_s/old_log_prob",
            "timing_s/values",
            "timing_s/update_actor",
            "timing_s/update_critic",
            "timing_s/push_weights",
            "timing_s/ref",
        )
    )
    # The reference's compute timer runs per call and calls overlap, so its sum can exceed the wall
    # time: it is reported, not counted. The overhead below is therefore an upper bound.
    compute = learner + counters["engine_busy_max_s"]
    overhead = max(0.0, 1 - compute / wall)
    print()
    print(f"  pipeline benchmark: {len(rows)} PPO steps, {wall:.1f} s of step wall time")
    print(
        f"  generated tokens/s (learner's wait)   {total('training/response_tokens') / total('timing_s/gen'):9.0f}"
    )
    print(
        f"  engine tokens/s while busy (all)      {total('training/response_tokens', rows) / max(counters['engine_busy_sum_s'], 1e-9):9.0f}"
    )
    print(
        f"  learner forward tokens/s              {total('training/tokens') / max(total('timing_s/old_log_prob') + total('timing_s/values'), 1e-9):9.0f}"
    )
    print(
        f"  learner update tokens/s               {total('training/tokens') / max(total('timing_s/update_actor') + total('timing_s/update_critic'), 1e-9):9.0f}"
    )
    print(f"  weight push, mean seconds             {total('timing_s/push_weights') / len(steady):9.3f}")
    print(
        f"  model compute: learner {learner:.1f} s + busiest engine {counters['engine_busy_max_s']:.1f} s "
        f"+ reference {counters['reference_s']:.1f} s = {compute:.1f} s"
    )
    print(
        f"  orchestration overhead                {overhead:9.1%}   (target <= 10%: {'met' if overhead <= 0.10 else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
