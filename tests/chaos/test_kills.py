"""Whole jobs through a kill: ``rlmesh train`` runs a small job (every service a real process, a
real Redis), the test ``kill -9``s one process mid-run, and the job must still finish its planned
steps having trained on every planned prompt group exactly once per step, each with all its samples
(the audit in ``tests/support/jobs.py``). Each scenario states its bound as the deadline of the
wait for the run to go on, and prints how long recovery took.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.jobs import (
    KILL_AT,
    LONG_RUN_STEPS,
    RECOVERY_BOUND_S,
    Files,
    Job,
    audit,
    engine_of,
    overrides,
    recovery_s,
    step_line,
    steps_started_after,
    stop_and_audit,
)
from tests.support.polling import wait_until
from tests.support.processes import pid_alive
from tests.support.repo import CPU_DEMO

pytestmark = pytest.mark.chaos  # `make chaos`; too long for `make test`
# Enough that the job is still running when the kill lands (progress lines come per poll, and a
# step of the demo takes 0.1 s on a fast machine), few enough for the resumed run to finish.
LEARNER_KILL_STEPS = 60


def kill_during_run(files: Files, run_dir: Path, targets: list[tuple[str, str]]) -> Job:
    """Runs a long job and ``kill -9``s each target in turn: ``(target, restarted)`` with target a
    service name or ``"engine of rollout-N"``, and ``restarted`` the service the supervisor must
    start again. The first kill comes once step KILL_AT is done; each next one once that service
    is back and two steps that began after the kill are done, within RECOVERY_BOUND_S. Then Ctrl-C stops
    the job cleanly (exit 130), and every step it committed must pass the audit. (Planned far
    longer than the kills take on any machine: a fast one would otherwise run out of steps first.)"""
    # The reference as a service of its own (the demo colocates it in the learner): one more to kill.
    job = Job.start(
        ["-c", str(CPU_DEMO), *overrides(files, run_dir, LONG_RUN_STEPS), "rlmesh.reference.colocated=false"]
    )
    kills = []
    try:
        job.wait_for(step_line(KILL_AT, LONG_RUN_STEPS), timeout_s=240)
        for target, restarted in targets:
            pid = engine_of(job.pid(target.split()[-1])) if target.startswith("engine") else job.pid(target)
            backs = job.count(rf"\] {restarted} is back")
            os.kill(pid, signal.SIGKILL)
            at = time.time()
            kills.append((target, pid, at))
            wait_until(
                lambda at=at: len(steps_started_after(run_dir, at)) >= 2,
                RECOVERY_BOUND_S,
                f"two steps after the kill of {target}",
            )
            job.wait_for_count(rf"\] {restarted} is back", backs + 1, timeout_s=RECOVERY_BOUND_S)
            wait_until(lambda p=pid: not pid_alive(p), 30, f"killed pid {pid} to be gone")
        committed = stop_and_audit(job, files, run_dir)
    finally:
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGINT)
            job.proc.wait(timeout=60)
    for target, pid, at in kills:
        print(
            f"\n[chaos] kill -9 {target} (pid {pid}): first step after it done {recovery_s(run_dir, at):.1f} s later"
        )
    assert committed > KILL_AT + 2 * len(targets)
    return job


@pytest.mark.timeout(900)
def test_a_run_goes_on_through_kill_9_of_every_process_but_the_learner(files, tmp_path):
    # One job through every failure in turn (a job each would cost a start-up each).
    targets = [
        ("rollout-0", "rollout-0"),  # a whole replica: the other takes its tasks over
        ("engine of rollout-1", "rollout-1"),  # an engine under a live replica: the replica ends
        ("reward", "reward"),
        ("reference", "reference"),
        ("redis", "redis"),  # restarted from its append-only file
    ]
    job = kill_during_run(files, tmp_path / "run", targets)
    for code, name in [(-9, "rollout-0"), (3, "rollout-1"), (-9, "reward"), (-9, "reference"), (-9, "redis")]:
        assert any(f"{name} exited with code {code}: restarting it" in line for line in job.lines), name
    log = next((tmp_path / "run" / "services").glob("*/logs/rollout-1.log")).read_text()
    assert "engine lost (its process exited with code -9" in log


@pytest.mark.timeout(600)
def test_a_killed_learner_fails_the_job_and_the_same_command_resumes(files, tmp_path):
    run_dir = tmp_path / "run"
    argv = ["-c", str(CPU_DEMO), *overrides(files, run_dir, LEARNER_KILL_STEPS)]
    job = Job.start(argv)
    job.wait_for(step_line(KILL_AT, LEARNER_KILL_STEPS), timeout_s=240)
    os.kill(job.pid("learner"), signal.SIGKILL)
    assert job.finish(timeout_s=120) != 0
    assert "the learner failed" in job.tail()
    again = Job.start(argv)
    again.wait_for(r"resumed from the checkpoint of step \d+", timeout_s=240)
    assert again.finish(timeout_s=300) == 0, again.tail()
    audit(files, run_dir, LEARNER_KILL_STEPS)
