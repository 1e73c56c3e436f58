"""Whole jobs through a kill: ``rlmesh train`` runs a small job (every service a real process, a
real Redis), the test ``kill -9``s one process mid-run the moment it holds work (claimed tasks,
decoding sequences, calls in flight, pending entries: ``work_of``), and the job must still finish
its planned steps having trained on every planned prompt group exactly once per step, each with all
its samples (the audit in ``tests/support/jobs.py``). Each scenario states its bound as the deadline
of the wait for the run to go on, and prints what the kill hit and how long recovery took.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from rlmesh.queue import LEARNER_GROUP, ROLLOUT_GROUP, RunKeys
from rlmesh.runtime.health import scrape_metrics
from rlmesh.runtime.launcher import EXIT_RESTART
from tests.support.jobs import (
    KILL_AT,
    LONG_RUN_STEPS,
    RECOVERY_BOUND_S,
    Files,
    Job,
    audit,
    engine_of,
    engine_url,
    job_redis_url,
    metric_sum,
    metrics_port,
    overrides,
    pending,
    recovery_s,
    run_id_of,
    saved_tokens,
    step_line,
    steps_started_after,
    stop_and_audit,
    wait_for_work,
)
from tests.support.polling import wait_until
from tests.support.processes import pid_alive
from tests.support.repo import CPU_DEMO

pytestmark = pytest.mark.chaos  # `make chaos`; too long for `make test`
# Enough that the job is still running when the kill lands (progress lines come per poll, and a
# step of the demo takes 0.1 s on a fast machine), few enough for the resumed run to finish.
LEARNER_KILL_STEPS = 60
# A standby takes over within a step or two, and the second kill waits for a new one to be built.
STANDBY_KILL_STEPS = 300
RPC_OF = {"reward": "/rlmesh.v1.Reward/Score", "reference": "/rlmesh.v1.Reference/LogProbs"}


def work_of(job: Job, run_dir: Path, target: str) -> tuple[str, Callable[[], float]]:
    """What a ``kill -9`` of ``target`` would lose, named, and how to count it now: a kill is shown
    to hit work in flight only when the count was above 0 right before it."""
    run_id = run_id_of(job)
    redis_url, keys = job_redis_url(job, run_dir), RunKeys(run_id)
    if target.startswith("engine of "):
        url = engine_url(redis_url, run_id, target.split()[-1])

        def running() -> float:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as page:
                return metric_sum(page.read().decode(), "rlmesh_engine_running_sequences")

        return "sequences decoding", running
    if target.startswith("rollout-"):  # its consumer's claims on the prompt stream
        return "prompt tasks claimed", lambda: pending(redis_url, keys.prompts, ROLLOUT_GROUP, target)
    if target in RPC_OF:
        port = metrics_port(run_dir, run_id, target)
        return f"{RPC_OF[target]} calls in flight", lambda: metric_sum(
            scrape_metrics("127.0.0.1", port), "rlmesh_rpc_in_flight", service=target, method=RPC_OF[target]
        )
    if target == "learner":  # trajectories it has read for its step and not yet committed
        return "trajectories taken", lambda: pending(redis_url, keys.trajectories, LEARNER_GROUP, "learner-0")
    assert target == "redis", target
    return (
        "stream entries pending",
        lambda: (
            pending(redis_url, keys.prompts, ROLLOUT_GROUP)
            + pending(redis_url, keys.trajectories, LEARNER_GROUP)
        ),
    )


def kill_at_work(job: Job, run_dir: Path, target: str, pid: int) -> str:
    """``kill -9 pid`` as soon as ``target`` holds work (waited for); returns what it held."""
    what, count = work_of(job, run_dir, target)
    held = wait_for_work(count, f"{target} to hold {what}")
    os.kill(pid, signal.SIGKILL)
    return f"{held:g} {what}"


def kill_during_run(
    files: Files,
    run_dir: Path,
    targets: list[tuple[str, str]],
    extra: tuple[str, ...] = (),
    before_stop: Callable[[float], None] | None = None,
) -> tuple[Job, list[float]]:
    """Runs a long job and ``kill -9``s each target in turn: ``(target, restarted)`` with target a
    service name or ``"engine of rollout-N"``, and ``restarted`` the service the supervisor must
    start again. The first kill comes once step KILL_AT is done; each next one once that service
    is back and two steps that began after the kill are done, within RECOVERY_BOUND_S. Then Ctrl-C stops
    the job cleanly (exit 130), and every step it committed must pass the audit. ``extra``: overrides
    of the job; ``before_stop(last kill's time)`` waits for what the test checks before the stop.
    Returns the job and when each kill landed. (Planned far
    longer than the kills take on any machine: a fast one would otherwise run out of steps first.)"""
    # The reference as a service of its own (the demo colocates it in the learner): one more to kill.
    job = Job.start(
        [
            "-c",
            str(CPU_DEMO),
            *overrides(files, run_dir, LONG_RUN_STEPS),
            "rlmesh.reference.colocated=false",
            *extra,
        ]
    )
    kills = []
    try:
        job.wait_for(step_line(KILL_AT, LONG_RUN_STEPS), timeout_s=240)
        for target, restarted in targets:
            pid = engine_of(job.pid(target.split()[-1])) if target.startswith("engine") else job.pid(target)
            backs = job.count(rf"\] {restarted} is back")
            held = kill_at_work(job, run_dir, target, pid)
            at = time.time()
            kills.append((target, pid, at, held))
            wait_until(
                lambda at=at: len(steps_started_after(run_dir, at)) >= 2,
                RECOVERY_BOUND_S,
                f"two steps after the kill of {target}",
            )
            job.wait_for_count(rf"\] {restarted} is back", backs + 1, timeout_s=RECOVERY_BOUND_S)
            wait_until(lambda p=pid: not pid_alive(p), 30, f"killed pid {pid} to be gone")
        if before_stop is not None:
            before_stop(kills[-1][2])
        committed = stop_and_audit(job, files, run_dir)
    finally:
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGINT)
            job.proc.wait(timeout=60)
    for target, pid, at, held in kills:
        print(
            f"\n[chaos] kill -9 {target} (pid {pid}) holding {held}: first step after it done "
            f"{recovery_s(run_dir, at):.1f} s later"
        )
    assert committed > KILL_AT + 2 * len(targets)
    return job, [at for _, _, at, _ in kills]


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
    job, _ = kill_during_run(files, tmp_path / "run", targets)
    for code, name in [(-9, "rollout-0"), (3, "rollout-1"), (-9, "reward"), (-9, "reference"), (-9, "redis")]:
        assert any(f"{name} exited with code {code}: restarting it" in line for line in job.lines), name
    log = next((tmp_path / "run" / "services").glob("*/logs/rollout-1.log")).read_text()
    assert "engine lost (its process exited with code -9" in log


@pytest.mark.timeout(900)
def test_replicas_sharing_one_weight_group_go_on_through_kill_9_of_each(files, tmp_path):
    # Both engines in one group: a kill spends the group for the other too; the replica back in the
    # registry and the survivor are grouped again.
    run_dir = tmp_path / "run"

    def one_group_of_both(rows):
        return [r for r in rows if r["weight_sync/engines"] == 2 and r["weight_sync/groups"] == 1]

    def regrouped(last_kill: float) -> None:
        wait_until(
            lambda: one_group_of_both(steps_started_after(run_dir, last_kill)),
            RECOVERY_BOUND_S,
            "a push to both replicas over one group after the kills",
        )

    targets = [("rollout-0", "rollout-0"), ("engine of rollout-1", "rollout-1")]
    job, kills = kill_during_run(files, run_dir, targets, ("rlmesh.weight_sync.group_size=2",), regrouped)
    assert any("rollout-0 exited with code -9: restarting it" in line for line in job.lines)
    assert any("rollout-1 exited with code 3: restarting it" in line for line in job.lines)
    before = [
        r for r in one_group_of_both(steps_started_after(run_dir, 0)) if r["timing_start/step"] < kills[0]
    ]
    assert before, "no push reached both replicas over one group before the kills"


@pytest.mark.timeout(900)
def test_a_replica_killed_mid_generation_is_resumed_elsewhere_from_its_saved_tokens(files, tmp_path):
    """Partial rollouts: answers of 24 tokens generated 4 at a time, each chunk saved with its task;
    ``kill -9`` of a replica holding saved tokens; the tasks it held are finished from them (the
    learner's ``rollout/resumed_tokens``), and the audit holds."""
    run_dir = tmp_path / "run"
    job = Job.start(
        [
            "-c",
            str(CPU_DEMO),
            *overrides(files, run_dir, LONG_RUN_STEPS),
            "actor_rollout_ref.rollout.response_length=24",
            "rlmesh.sampler.partial_chunk_tokens=4",
        ]
    )
    try:
        job.wait_for(step_line(KILL_AT, LONG_RUN_STEPS), timeout_s=240)
        redis_url, keys = job_redis_url(job, run_dir), RunKeys(run_id_of(job))
        pid, backs = job.pid("rollout-0"), job.count(r"\] rollout-0 is back")
        held = wait_for_work(
            lambda: saved_tokens(redis_url, keys, "rollout-0"), "rollout-0 to hold saved tokens"
        )
        os.kill(pid, signal.SIGKILL)
        at = time.time()

        def resumed() -> float:  # the step in collection at the kill began before it: every step counts
            return sum(row.get("rollout/resumed_tokens", 0) for row in steps_started_after(run_dir, 0))

        wait_until(
            lambda: resumed() > 0 and len(steps_started_after(run_dir, at)) >= 2,
            RECOVERY_BOUND_S,
            "a step with tokens resumed after the kill, and two steps begun after it",
        )
        rows = steps_started_after(run_dir, 0)
        before = [r for r in rows if r["timing_start/step"] + r["timing_s/step"] < at]
        assert before and not any(r.get("rollout/resumed_tokens") for r in before), "resumed before the kill"
        job.wait_for_count(r"\] rollout-0 is back", backs + 1, timeout_s=RECOVERY_BOUND_S)
        committed = stop_and_audit(job, files, run_dir)
    finally:
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGINT)
            job.proc.wait(timeout=60)
    print(
        f"\n[chaos] kill -9 rollout-0 (pid {pid}) holding {held:g} saved tokens: {resumed():g} tokens "
        f"resumed instead of generated again; first step after it done {recovery_s(run_dir, at):.1f} s later"
    )
    assert committed > KILL_AT


def learner_rank(job: Job, rank: int) -> int:
    """The pid of learner rank ``rank``: rank 0 is the service, ranks 1.. its children."""
    service = job.pid("learner")
    if rank == 0:
        return service
    children = []
    for task in Path(f"/proc/{service}/task").iterdir():
        children += [int(p) for p in (task / "children").read_text().split()]
    ranks = {
        int(env[5:]): child
        for child in children
        for env in Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if env.startswith(b"RANK=")
    }
    assert rank in ranks, f"no learner rank {rank} among the children of {service}: {ranks}"
    return ranks[rank]


def kill_learner_twice(files: Files, run_dir: Path, rank: int, extra: list[str]) -> list[str]:
    """Runs a job of LEARNER_KILL_STEPS steps (STANDBY_KILL_STEPS with a standby) and ``kill -9``s learner rank ``rank`` twice, each
    time while it holds trajectories of a step, the second once the replaced learner committed two
    steps. No one acts: `rlmesh train` must replace the learner each time and finish the plan, and
    the audit hold across both failovers. Returns a line per kill: what it hit, the time from it to
    the next committed step, and the steps done again."""
    standby = "rlmesh.learner.standbys=1" in extra
    steps = STANDBY_KILL_STEPS if standby else LEARNER_KILL_STEPS
    job = Job.start(["-c", str(CPU_DEMO), *overrides(files, run_dir, steps), *extra])
    kills = []
    try:
        job.wait_for(step_line(KILL_AT, steps), timeout_s=240)
        for kill in range(2):
            if standby:  # the one started in place of the standby that took over the first time
                job.wait_for_count(r"\] learner-standby is back", kill, timeout_s=RECOVERY_BOUND_S)
            backs = job.count(r"\] learner is back")
            held = kill_at_work(job, run_dir, "learner", learner_rank(job, rank))
            at = time.time()
            kills.append((at, held))
            job.wait_for_count(r"\] learner is back", backs + 1, timeout_s=RECOVERY_BOUND_S)
            wait_until(
                lambda at=at: len(steps_started_after(run_dir, at)) >= 2,
                RECOVERY_BOUND_S,
                "two steps of the new learner",
            )
        assert job.finish(timeout_s=300) == 0, job.tail()
    finally:
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGINT)
            job.proc.wait(timeout=60)
    code = -9 if rank == 0 else EXIT_RESTART
    how = "its warm standby takes over" if standby else "restarting it"
    assert job.count(rf"\] learner exited with code {code}: {how}") == 2, job.tail()
    audit(files, run_dir, steps)
    if standby:  # each standby's log lines, the promoted ones' included, go to one file
        log = next(run_dir.glob("services/*/logs/learner-standby.log")).read_text()
        # Two took over; the last one saw its learner finish the run and did not take it over
        # (or was stopped first, as the job ended).
        assert log.count("standby: took over the learner lease") == 2, log[-3000:]
        assert "finished: no standby takes it over" in log or "it never took over" in log, log[-3000:]
    lines = []
    for at, held in kills:
        first = steps_started_after(run_dir, at)[0]
        lines.append(
            f"kill -9 learner rank {rank} holding {held}: next step committed {recovery_s(run_dir, at):.1f} s "
            f"later, {first['training/redone_steps']:.0f} step(s) done again"
        )
    for line in lines:
        print(f"\n[chaos] {line}")
    return lines


@pytest.mark.timeout(900)
def test_a_killed_learner_is_replaced_twice_and_the_run_finishes_its_plan(files, tmp_path):
    kill_learner_twice(files, tmp_path / "run", 0, [])


@pytest.mark.timeout(900)
def test_a_killed_rank_of_a_two_rank_learner_is_replaced_twice(files, tmp_path):
    kill_learner_twice(files, tmp_path / "run", 1, ["rlmesh.learner.ranks=2"])


@pytest.mark.timeout(900)
def test_a_killed_learner_is_replaced_twice_by_its_warm_standby(files, tmp_path):
    kill_learner_twice(files, tmp_path / "run", 0, ["rlmesh.learner.standbys=1"])


@pytest.mark.timeout(900)
def test_a_killed_rank_of_a_two_rank_learner_is_replaced_twice_by_its_warm_standby(files, tmp_path):
    kill_learner_twice(files, tmp_path / "run", 1, ["rlmesh.learner.ranks=2", "rlmesh.learner.standbys=1"])
