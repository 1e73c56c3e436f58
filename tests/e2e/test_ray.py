"""``rlmesh ray up`` on a real Ray cluster of two nodes on this machine: every service an actor, the
replica placed on the second node by a custom resource; its actor is killed mid-run and the job still
trains every step; the learner's service is killed mid-run and Ray's restart of its actor resumes the
run from its checkpoint, the control plane following it; ``rlmesh ray down`` stops a run from
outside, leaving no process behind."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.autoscale import autoscale_keys
from tests.support.jobs import (
    LONG_RUN_STEPS,
    Files,
    Job,
    audit,
    committed_steps,
    engine_of,
    make_files,
    overrides,
)
from tests.support.monitoring import DIRECT
from tests.support.polling import wait_until
from tests.support.processes import child_env, pid_alive
from tests.support.ray_cluster import RayCluster, start_cluster
from tests.support.repo import CPU_DEMO, REPO

try:  # the `cluster` extra: `make ray-test` installs it; `make test` deselects these tests (-m "not ray")
    import ray
except ImportError:  # collected without it, these tests fail loudly when selected, never skip
    ray = None

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

STEPS = 40
LEARNER_STEPS = 12  # few: the learner is killed after its first steps, and the run redoes a few
NAMESPACE = "rlmesh"


class RayJob(Job):
    """``rlmesh ray ...`` as a subprocess, its output read as it comes."""

    command = "ray"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    if ray is None:
        pytest.fail("ray is not installed: `make ray-test` installs the cluster extra first")
    c = start_cluster()
    try:
        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
        wait_until(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, 60, "both Ray nodes to be alive")
        yield c
    finally:
        ray.shutdown()
        left = c.stop()
        shutil.rmtree(c.root, ignore_errors=True)
        assert not left, f"Ray processes left after stopping the cluster (killed): {left}"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    return make_files(tmp_path_factory.mktemp("ray-files"))


def node_with(resource: str) -> str:
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node


def up_argv(cluster: RayCluster, files: Files, run_dir: Path, run_id: str, steps: int) -> list[str]:
    return [
        "up",
        "-c",
        str(CPU_DEMO),
        "--address",
        cluster.address,
        # The replica on the second node, the rest on the head: placement across nodes.
        "--resources",
        'rollout={"node2": 1}',
        "--resources",
        'redis={"head": 0.1}',
        "--resources",
        'reward={"head": 0.1}',
        "--resources",
        'learner={"head": 0.1}',
        "--max-restarts",
        "2",
        *overrides(files, run_dir, steps),
        "rlmesh.rollout.replicas=1",
        f"rlmesh.run_id={run_id}",
        # Services bind the nodes' address, which is this machine's: open on purpose, no token.
        "rlmesh.security.allow_open_bind=true",
    ]


def stop_if_running(job: Job) -> None:
    """A test that failed half-way leaves no `ray up` behind: Ctrl-C stops it and its actors."""
    if job.proc.poll() is None:
        job.proc.send_signal(signal.SIGINT)
        job.proc.wait(timeout=120)


def actor(run_id: str, name: str) -> Any:
    return ray.get_actor(f"{run_id}/{name}", namespace=NAMESPACE)


def status(run_id: str, name: str, timeout_s: float = 60) -> dict[str, Any]:
    # rows=False: the learner's metrics rows are for `ray up`'s progress lines, not this test.
    return ray.get(actor(run_id, name).status.remote(rows=False), timeout=timeout_s)


def restarted_status(run_id: str, name: str, old_actor_pid: int, timeout_s: float) -> dict[str, Any]:
    """The status of ``name``'s next incarnation: a call made while Ray restarts the actor waits for
    the new constructor (the service healthy again); one that reached the dying worker fails, and
    for a moment the name may not resolve at all (ValueError) while the GCS restarts the actor."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"{name} was not restarted within {timeout_s} s"
        try:
            st = status(run_id, name, timeout_s=left)
        except (ray.exceptions.RayActorError, ValueError):
            time.sleep(0.2)  # a poll interval, not a synchronisation: the loop has its deadline
            continue
        if st["actor_pid"] != old_actor_pid:
            return st


def learner_call(address: str, method: str) -> Any:
    """The learner's ``method`` (Pause, Resume) over its gRPC control API."""
    import grpc

    from rlmesh.v1 import common_pb2, learner_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return getattr(learner_pb2_grpc.LearnerStub(channel), method)(common_pb2.Empty(), timeout=30)


def registered_address(redis_url: str, run_id: str, replica_id: str) -> str | None:
    import redis

    from rlmesh.queue.keys import RunKeys
    from rlmesh.v1 import trajectory_pb2

    with redis.Redis.from_url(redis_url) as client:
        raw = client.get(RunKeys(run_id).replica(replica_id))
    return trajectory_pb2.ReplicaRegistration.FromString(raw).grpc_address if raw else None


def run_actors(run_id: str) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith(f"{run_id}/")
    ]


def test_a_job_on_two_nodes_survives_the_kill_of_its_replica_actor(cluster, files, tmp_path):
    run_id, run_dir = f"ray-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    job = RayJob.start(up_argv(cluster, files, run_dir, run_id, STEPS))
    pids: list[int] = []
    try:
        job.wait_for(rf"^\[ray\] step +1/{STEPS} ", timeout_s=400)
        # The learner holds between steps while the replica dies and comes back, so that the kill
        # lands mid-run however fast this machine trains (a step here can take 0.1 s).
        learner_call(status(run_id, "learner")["address"], "Pause")
        head, node2 = node_with("head"), node_with("node2")
        placed = {name: status(run_id, name) for name in ("redis", "reward", "rollout-0", "learner")}
        assert placed["rollout-0"]["node_id"] == node2
        assert placed["rollout-0"]["resources"].get("node2") == 1
        for name in ("redis", "reward", "learner"):
            assert placed[name]["node_id"] == head, f"{name} ran on {placed[name]['node_id']}, not the head"
        before = placed["rollout-0"]
        engine = engine_of(before["pid"])
        pids = [st["pid"] for st in placed.values()] + [engine]
        # The control plane is an actor too, pointed at the learner wherever Ray put it.
        plane = status(run_id, "control")
        pids.append(plane["pid"])
        with DIRECT.open(f"http://{plane['address']}/api/v1/run/status", timeout=30) as r:
            assert json.load(r)["run_id"] == run_id

        ray.kill(actor(run_id, "rollout-0"), no_restart=False)
        after = restarted_status(run_id, "rollout-0", before["actor_pid"], timeout_s=300)
        assert after["restarted"] is True
        assert after["node_id"] == node2
        assert after["address"] != before["address"]
        pids += [after["pid"], engine_of(after["pid"])]
        # The killed actor's service and its engine died with its worker (parent-death signal).
        for pid in (before["pid"], engine):
            wait_until(lambda p=pid: not pid_alive(p), 60, f"pid {pid} of the killed replica to exit")
        # It rejoined the run through the replica registry, at its new address.
        wait_until(
            lambda: registered_address(placed["redis"]["address"], run_id, "rollout-0") == after["address"],
            60,
            "rollout-0 to register its new address",
        )
        job.wait_for(r"^\[ray\] rollout-0 is back: ", timeout_s=60)
        learner_call(placed["learner"]["address"], "Resume")
        assert job.finish(timeout_s=600) == 0, job.tail()
    finally:
        stop_if_running(job)
        print("\n" + job.tail(60))  # what `ray up` said, for -s and failures
    assert job.count(rf"^\[ray\] step +{STEPS}/{STEPS} ") == 1, job.tail()
    assert job.count(r"^\[ray\] every actor stopped") == 1, job.tail()
    audit(files, run_dir, STEPS)  # every step trained on its planned prompts, every sample
    assert not [p for p in pids if pid_alive(p)], "service processes outlived the job"
    wait_until(lambda: not run_actors(run_id), 60, f"the actors of {run_id} to be gone")


def control_status(address: str) -> dict[str, Any] | None:
    """The run's status as the control plane at ``address`` answers it from the learner it points
    at; None while it cannot (its learner gone, or it restarting)."""
    try:
        with DIRECT.open(f"http://{address}/api/v1/run/status", timeout=10) as r:
            return json.load(r)
    except (urllib.error.URLError, ConnectionError, TimeoutError):  # an HTTP error is a URLError
        return None


def trained_steps(run_dir: Path) -> list[int]:
    """The steps of the learner's metrics rows in the order they were written, every learner's (a
    line still being written left out)."""
    path = run_dir / "metrics.jsonl"
    whole = path.read_text().rpartition("\n")[0] if path.exists() else ""
    rows = [json.loads(line) for line in whole.splitlines() if line]
    return [int(row["step"]) for row in rows if "timing_s/step" in row]


def test_a_job_survives_the_kill_9_of_its_learner_service(cluster, files, tmp_path):
    run_id, run_dir, steps = f"ray-{uuid.uuid4().hex[:6]}", tmp_path / "run", LEARNER_STEPS
    # Every learner holds before its first step until resumed: the first is let run a few steps and
    # held again before the kill (a step can take 0.1 s: the whole run could be over before a
    # progress line is read), its successor is held until the control plane is checked.
    job = RayJob.start([*up_argv(cluster, files, run_dir, run_id, steps), "rlmesh.learner.start_paused=true"])
    pids: list[int] = []
    try:
        job.wait_for(r"^\[ray\] \d+ actors healthy", timeout_s=400)
        before = status(run_id, "learner")
        learner_call(before["address"], "Resume")
        wait_until(lambda: len(trained_steps(run_dir)) >= 3, 300, "the learner's first 3 steps")
        learner_call(before["address"], "Pause")  # it finishes the step under way, then holds
        plane = status(run_id, "control")
        pids += [status(run_id, n)["pid"] for n in ("redis", "reward", "rollout-0")]
        pids += [before["pid"], plane["pid"]]
        os.kill(before["pid"], signal.SIGKILL)  # the service, not its actor: its shell ends the actor
        after = restarted_status(run_id, "learner", before["actor_pid"], timeout_s=300)
        pids.append(after["pid"])
        assert after["restarted"] is True
        assert after["pid"] != before["pid"]
        job.wait_for(r"^\[ray\] the learner's actor died \(.+\): Ray restarts it \(1 of 2\)", timeout_s=60)
        job.wait_for(r"^\[ray\] learner is back: ", timeout_s=60)
        # The control plane, at its same URL, answers through the new learner: the old one is dead.
        wait_until(
            lambda: (control_status(plane["address"]) or {}).get("paused") is True,
            120,
            "the control plane to answer through the restarted learner",
        )
        pids.append(status(run_id, "control")["pid"])
        learner_call(after["address"], "Resume")
        assert job.finish(timeout_s=600) == 0, job.tail()
    finally:
        stop_if_running(job)
        print("\n" + job.tail(60))  # what `ray up` said, for -s and failures
    assert job.count(r"^\[ray\] the learner's actor died") == 1, job.tail()
    assert job.count(r"^\[ray\] control plane: pointed at the new learner") == 1, job.tail()
    assert job.count(rf"^\[ray\] run {run_id} finished at step {steps} ") == 1, job.tail()
    # It resumed: a step redone after a later or the same one (from an earlier checkpoint, or from
    # none), or the first step after the one it was killed at, said as a resume.
    done = trained_steps(run_dir)
    redone = any(later <= earlier for earlier, later in itertools.pairwise(done))
    resumed = job.count(r"^\[ray\] resumed from the checkpoint of step [1-9]")
    assert (redone or resumed == 1) and resumed <= 1, f"steps {done}, resume lines {resumed}:\n{job.tail()}"
    # A line for every step, the dead learner's last ones (written after the driver's last call) too.
    unsaid = [s for s in range(1, steps + 1) if not job.count(rf"^\[ray\] step +{s}/{steps} ")]
    assert not unsaid, f"no progress line for steps {unsaid}:\n{job.tail()}"
    groups = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert len({row["incarnation"] for row in groups}) == 2, "not two learners"
    audit(files, run_dir, steps)  # every step trained once on its planned prompts, redone ones too
    assert not [p for p in pids if pid_alive(p)], "service processes outlived the job"
    wait_until(lambda: not run_actors(run_id), 60, f"the actors of {run_id} to be gone")


def test_ray_down_stops_a_running_job_and_everything_it_started(cluster, files, tmp_path):
    run_id, run_dir = f"ray-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    job = RayJob.start(up_argv(cluster, files, run_dir, run_id, 200))
    try:
        job.wait_for(r"^\[ray\] \d+ actors healthy", timeout_s=400)
        pids = [status(run_id, n)["pid"] for n in ("redis", "reward", "rollout-0", "learner")]
        down = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlmesh.cli",
                "ray",
                "down",
                "--address",
                cluster.address,
                "--run-id",
                run_id,
            ],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert down.returncode == 0, down.stdout + down.stderr
        assert "every actor stopped (5)" in down.stdout, down.stdout  # the control plane too
        assert job.finish(timeout_s=180) == 1, job.tail()
    finally:
        stop_if_running(job)
    assert job.count(r"stopped from outside|actor died") >= 1, job.tail()
    assert not [p for p in pids if pid_alive(p)], "service processes outlived ray down"
    wait_until(lambda: not run_actors(run_id), 60, f"the actors of {run_id} to be gone")


def test_sigterm_to_ray_up_stops_every_actor_and_service(cluster, files, tmp_path):
    run_id, run_dir = f"ray-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    job = RayJob.start(up_argv(cluster, files, run_dir, run_id, 200))
    try:
        job.wait_for(r"^\[ray\] \d+ actors healthy", timeout_s=400)
        pids = [status(run_id, n)["pid"] for n in ("redis", "reward", "rollout-0", "learner", "control")]
        job.proc.send_signal(signal.SIGTERM)
        assert job.finish(timeout_s=180) == 130, job.tail()
    finally:
        stop_if_running(job)
    assert job.count(r"^\[ray\] every actor stopped \(5\)") == 1, job.tail()
    assert not [p for p in pids if pid_alive(p)], "service processes outlived ray up"
    wait_until(lambda: not run_actors(run_id), 60, f"the actors of {run_id} to be gone")


def test_the_autoscaler_adds_a_replica_actor_mid_run_and_the_audit_holds(cluster, files, tmp_path):
    """rlmesh.control.autoscale on a Ray job: one replica actor of one task slot, whose queued
    batches call for more; the job's actuator creates a second replica actor, Ray places it, it
    registers and trains with the first, and every step committed passes the audit. (Planned far
    longer than that takes on any machine, then stopped: the demo's steps take 0.2 s here.)"""
    run_id, run_dir = f"ray-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    argv = [
        "up",
        "-c",
        str(CPU_DEMO),
        "--address",
        cluster.address,
        # Room for a second replica on the cluster's 3 CPUs, wherever Ray places it.
        "--num-cpus",
        "rollout=0.5",
        "--num-cpus",
        "reward=0.5",
        *overrides(files, run_dir, LONG_RUN_STEPS),
        "rlmesh.rollout.replicas=1",
        "rlmesh.sampler.tasks_in_flight=1",
        *autoscale_keys(min_replicas=1, max_replicas=2),
        f"rlmesh.run_id={run_id}",
        "rlmesh.security.allow_open_bind=true",
    ]
    job = RayJob.start(argv)
    try:
        job.wait_for(r"autoscaler: between 1 and 2 replica actors, from the load", timeout_s=400)
        job.wait_for(r"^\[ray\] rollout-1 +\S+ \(pid \d+, added by the autoscaler\)", timeout_s=400)
        assert f"{run_id}/rollout-1" in run_actors(run_id)
        added, redis_url = status(run_id, "rollout-1"), status(run_id, "redis")["address"]
        wait_until(
            lambda: registered_address(redis_url, run_id, "rollout-1") == added["address"],
            60,
            "rollout-1 to register",
        )
        steps = job.count(r"^\[ray\] step +\d+/")
        job.wait_for_count(r"^\[ray\] step +\d+/", steps + 3, timeout_s=120)
        job.proc.send_signal(signal.SIGINT)
        assert job.finish(timeout_s=180) == 130, job.tail()
    finally:
        stop_if_running(job)
        print("\n" + job.tail(60))
    assert job.count(r"^\[ray\] every actor stopped \(6\)") == 1, job.tail()
    audit(files, run_dir, committed_steps(run_dir))
    wait_until(lambda: not run_actors(run_id), 60, f"the actors of {run_id} to be gone")
