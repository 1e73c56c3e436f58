"""A network partition of one rollout replica during a whole job.

``rlmesh train`` runs the job with one replica of its own; the test starts a second one "across
the network": every connection it makes (Redis, reward, reference) and every connection made to
it (the learner's gRPC calls and weight pushes to its engine, through its advertised addresses)
goes through a proxy the test controls. Mid-run the proxies stop forwarding anything, without
closing a connection, for longer than the claim timeout: the replica must drop out of the
registry, its claimed tasks must be reclaimed by the other replica, the run must go on within the
bound, and once the partition heals the replica must register and work again and the job must
finish having trained on every planned group exactly once (the late results of the partitioned
replica are not trained on twice).

What the run loses is time: a weight push under way to the cut-off engine waits for its pause call
for ``rlmesh.weight_sync.control_timeout_s`` (at most ``timeout_s``: 10 s here; 30 s by default)
before the learner drops it from that push; by the next push the replica has left the registry."""

from __future__ import annotations

import asyncio
import signal
import time
from urllib.parse import urlparse

import grpc
import pytest
import redis as redis_sync

from rlmesh.queue import ROLLOUT_GROUP, ReplicaRegistry, RunKeys, connect
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.net import free_port
from rlmesh.v1 import common_pb2, rollout_pb2_grpc
from tests.support.jobs import (
    KILL_AT,
    LONG_RUN_STEPS,
    RECOVERY_BOUND_S,
    Files,
    Job,
    overrides,
    private_redis_url,
    step_line,
    steps_started_after,
    stop_and_audit,
    wait_for_work,
)
from tests.support.netproxy import PartitionableProxy
from tests.support.polling import wait_until
from tests.support.repo import CPU_DEMO

pytestmark = pytest.mark.chaos  # `make chaos`; too long for `make test`

RUN_ID = "chaos-partition"
OUTSIDE = "rollout-outside"


def job_address(job: Job, service: str) -> tuple[str, int]:
    """host, port of a service the job started, from its start-up lines."""
    text = job.wait_for(rf"^\[train\] {service} +(\S+) \(pid", timeout_s=240)[1]
    parsed = urlparse(text if "://" in text else f"tcp://{text}")
    assert parsed.hostname and parsed.port, text
    return parsed.hostname, parsed.port


def tasks_done(grpc_port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        return rollout_pb2_grpc.RolloutStub(channel).GetInfo(common_pb2.Empty(), timeout=10).tasks_done


def registered(redis_url: str) -> set[str]:
    async def live() -> set[str]:
        client = connect(redis_url)
        try:
            return {r.replica_id for r in await ReplicaRegistry(client, RunKeys(RUN_ID)).live()}
        finally:
            await client.aclose()

    return asyncio.run(live())


def claims_held_by(redis_url: str, consumer: str) -> int:
    with redis_sync.Redis.from_url(redis_url) as client:
        pending = client.xpending_range(RunKeys(RUN_ID).prompts, ROLLOUT_GROUP, "-", "+", 1000, consumer)
    return len(pending)


@pytest.mark.timeout(900)
def test_a_partitioned_replica_is_replaced_and_its_late_results_are_not_trained_twice(files: Files, tmp_path):
    run_dir = tmp_path / "run"
    # The reference as a service (the demo colocates it): the outside replica calls it too.
    common = [
        *overrides(files, run_dir, LONG_RUN_STEPS),
        f"rlmesh.run_id={RUN_ID}",
        "rlmesh.weight_sync.timeout_s=10",
        "rlmesh.reference.colocated=false",
    ]
    job = Job.start(["-c", str(CPU_DEMO), *common, "rlmesh.rollout.replicas=1"])
    proxies: list[PartitionableProxy] = []
    try:
        redis_host, redis_port = job_address(job, "redis")
        # The job's Redis has a password (masked where the job prints its URL).
        printed = job.wait_for(r"^\[train\] redis +(redis://\S+)", timeout_s=240)[1]
        redis_url = private_redis_url(run_dir / "services" / RUN_ID, printed)
        password = urlparse(redis_url).password
        reward = PartitionableProxy(*job_address(job, "reward"))
        reference = PartitionableProxy(*job_address(job, "reference"))
        redis_proxy = PartitionableProxy(redis_host, redis_port)
        grpc_port, engine_port = free_port(), free_port()
        to_replica, to_engine = (
            PartitionableProxy("127.0.0.1", grpc_port),
            PartitionableProxy("127.0.0.1", engine_port),
        )
        proxies = [reward, reference, redis_proxy, to_replica, to_engine]
        job.wait_for(step_line(KILL_AT, LONG_RUN_STEPS), timeout_s=240)
        with ProcessLauncher(tmp_path / "outside", stop_grace_s=10) as launcher:
            launcher.start_service(
                "rollout",
                name=OUTSIDE,
                config_path=str(CPU_DEMO),
                overrides=[
                    *common,
                    f"rlmesh.redis_url=redis://:{password}@{redis_proxy.address}/0",
                    f"rlmesh.reward.addresses=['{reward.address}']",
                    f"rlmesh.reference.addresses=['{reference.address}']",
                    f"rlmesh.rollout.port={grpc_port}",
                    "rlmesh.rollout.metrics_port=0",
                    f"rlmesh.rollout.advertise_address={to_replica.address}",
                    f"rlmesh.sampler.engine_port={engine_port}",
                    f"rlmesh.sampler.engine_advertise_url=http://{to_engine.address}",
                    f"rlmesh.sampler.replica_id={OUTSIDE}",
                ],
                timeout_s=240,
            )
            wait_until(lambda: tasks_done(grpc_port) >= 2, 240, f"{OUTSIDE} to finish tasks")

            # Cut while it holds claims: the other replica must be shown to take them over.
            held = wait_for_work(lambda: claims_held_by(redis_url, OUTSIDE), f"{OUTSIDE} to hold claims")
            for proxy in proxies:
                proxy.partition()
            cut_at = time.time()
            wait_until(
                lambda: len(steps_started_after(run_dir, cut_at)) >= 2,
                RECOVERY_BOUND_S,
                "two steps after the cut",
            )
            wait_until(lambda: OUTSIDE not in registered(redis_url), RECOVERY_BOUND_S, f"{OUTSIDE} to expire")
            # Longer than the claim timeout: whatever it had claimed, the other replica took over.
            wait_until(
                lambda: claims_held_by(redis_url, OUTSIDE) == 0,
                RECOVERY_BOUND_S,
                f"{OUTSIDE}'s tasks reclaimed",
            )
            went_on_s = time.time() - cut_at
            tasks_before_heal = tasks_done(grpc_port)
            for proxy in proxies:
                proxy.heal()
            healed_at = time.time()
            # Healed, it comes back: registered again and working.
            wait_until(
                lambda: OUTSIDE in registered(redis_url), RECOVERY_BOUND_S, f"{OUTSIDE} to register again"
            )
            wait_until(
                lambda: tasks_done(grpc_port) > tasks_before_heal,
                RECOVERY_BOUND_S,
                f"{OUTSIDE} to work again",
            )
            back_s = time.time() - healed_at
            stop_and_audit(job, files, run_dir)
    finally:
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGINT)
            job.proc.wait(timeout=60)
        for proxy in proxies:
            proxy.close()
    print(
        f"\n[chaos] partition of {OUTSIDE} holding {held:g} prompt tasks claimed: run went 2 steps on, "
        f"replica expired and its claims taken over {went_on_s:.1f} s after the cut; back at work "
        f"{back_s:.1f} s after the heal"
    )
