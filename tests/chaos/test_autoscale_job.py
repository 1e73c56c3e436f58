"""``rlmesh train`` with the autoscaler on (docs/control.md#autoscaling): a job started with one
replica of one task slot, whose queued batches call for more, grows its fleet mid-run through its
own actuator; the replica added joins at the run's current weights and publishes trajectories the
learner trains on, and every step the job committed passes the audit. The scale-down side (drained
replicas, nothing lost) is tests/integration/control/test_autoscale.py's."""

from __future__ import annotations

import signal
import time

import pytest

from rlmesh.runtime.health import scrape_metrics
from tests.support.autoscale import autoscale_keys
from tests.support.jobs import (
    LONG_RUN_STEPS,
    RECOVERY_BOUND_S,
    Files,
    Job,
    metric_sum,
    metrics_port,
    overrides,
    run_id_of,
    steps_started_after,
    stop_and_audit,
)
from tests.support.polling import wait_until
from tests.support.repo import CPU_DEMO

pytestmark = pytest.mark.chaos  # `make chaos`: a whole job


@pytest.mark.timeout(600)
def test_a_job_grows_its_fleet_mid_run_and_the_audit_holds(files: Files, tmp_path):
    run_dir = tmp_path / "run"
    job = Job.start(
        [
            "-c",
            str(CPU_DEMO),
            *overrides(files, run_dir, LONG_RUN_STEPS),
            "rlmesh.rollout.replicas=1",
            "rlmesh.sampler.tasks_in_flight=1",
            *autoscale_keys(min_replicas=1, max_replicas=2),
        ]
    )
    try:
        job.wait_for(r"autoscaler: between 1 and 2 replicas, from the load", timeout_s=240)
        job.wait_for(r"\] rollout-1 +\S+ \(pid \d+, added by the autoscaler\)", timeout_s=240)
        joined = time.time()
        port = metrics_port(run_dir, run_id_of(job), "rollout-1")

        def published() -> float:
            return metric_sum(scrape_metrics("127.0.0.1", port), "rlmesh_rollout_trajectories_total")

        wait_until(
            lambda: len(steps_started_after(run_dir, joined)) >= 3 and published() > 0,
            RECOVERY_BOUND_S,
            "three steps after rollout-1 joined, with its trajectories among them",
        )
        committed = stop_and_audit(job, files, run_dir)
    finally:
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGINT)
            job.proc.wait(timeout=60)
    assert committed >= 3
    print(f"\n[chaos] the fleet grew to 2 mid-run; {committed} steps committed and audited")
