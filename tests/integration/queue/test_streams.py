"""Prompt and trajectory streams against a real redis-server."""

import subprocess
import time

import pytest

from rlmesh.queue import (
    QueueFullError,
    QueueMetrics,
    ReplicaRegistry,
    RunKeys,
    TrajectoryCollector,
    prompt_queue,
    trajectory_queue,
)
from rlmesh.v1 import trajectory_pb2
from tests.support.processes import child_env, program
from tests.support.repo import REPO


def tasks(n, prefix="t"):
    return [
        trajectory_pb2.PromptTask(uid=f"{prefix}{i}", group_uid=f"g{i}", n=2, prompt_ids=[i, i + 1])
        for i in range(n)
    ]


def traj(uid):
    return trajectory_pb2.Trajectory(uid=uid, group_uid=uid.split("/")[0], response_ids=[1, 2, 3], score=1.0)


async def test_tasks_come_out_in_order_and_stay_until_acked(redis, keys):
    producer = prompt_queue(redis, keys, "learner")
    a = prompt_queue(redis, keys, "replica-a")
    b = prompt_queue(redis, keys, "replica-b")
    await a.ensure_group()
    await producer.put(tasks(6))
    first = await a.claim(4)
    assert [d.message.uid for d in first] == ["t0", "t1", "t2", "t3"]
    assert all(d.deliveries == 1 for d in first)
    rest = await b.claim(10)
    assert [d.message.uid for d in rest] == ["t4", "t5"]
    assert await a.length() == 6 and await a.pending() == 6
    # b may not take a's unacked tasks while a is alive (not idle for claim_idle_ms).
    assert await b.claim(10) == []
    await a.ack([d.entry_id for d in first])
    assert await a.length() == 2 and await a.pending() == 2
    await b.ack([d.entry_id for d in rest] * 2)  # double ack is harmless
    assert await a.length() == 0 and await a.pending() == 0


async def test_a_sigkilled_consumers_tasks_are_reclaimed_by_another(redis_server, redis, keys):
    producer = prompt_queue(redis, keys, "learner")
    await producer.ensure_group()
    await producer.put(tasks(5))
    proc = subprocess.Popen(
        program("hanging_consumer", redis_server.url, keys.run_id, 3),
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        claimed_by_doomed = proc.stdout.readline().split()
        assert claimed_by_doomed == ["t0", "t1", "t2"]
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    survivor = prompt_queue(redis, keys, "survivor", claim_idle_ms=200)
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < 5 and time.monotonic() < deadline:
        for d in await survivor.claim(5, block_ms=100):
            got[d.message.uid] = d
    assert sorted(got) == ["t0", "t1", "t2", "t3", "t4"]
    assert {uid for uid, d in got.items() if d.deliveries == 2} == {"t0", "t1", "t2"}
    await survivor.ack([d.entry_id for d in got.values()])
    assert await survivor.length() == 0


async def test_learner_dedupes_by_uid_and_never_trains_a_uid_twice(redis, keys):
    producer = trajectory_queue(redis, keys, "replica")
    learner = trajectory_queue(redis, keys, "learner-0")
    await learner.ensure_group()
    collector = TrajectoryCollector(learner, keys.used_uids)
    await producer.put([traj("g0/0"), traj("g0/1"), traj("g0/0"), traj("g1/0")])
    batch = await collector.collect_until(3, timeout_s=10)
    assert batch.uids == ["g0/0", "g0/1", "g1/0"] and batch.duplicates == 1
    await collector.commit(batch)
    assert await learner.length() == 0
    # A late redelivery of a used uid is dropped (and acked), a new uid is not.
    await producer.put([traj("g0/1"), traj("g2/0")])
    batch2 = await collector.collect_until(1, timeout_s=10)
    assert batch2.uids == ["g2/0"]
    assert await collector.used(["g0/0", "g2/0"]) == [True, False]


async def test_learner_restart_before_ack_recovers_its_batch_once(redis, keys):
    producer = trajectory_queue(redis, keys, "replica")
    learner = trajectory_queue(redis, keys, "learner-0")
    await learner.ensure_group()
    await producer.put([traj(f"g{i}/0") for i in range(4)])
    before_crash = await TrajectoryCollector(learner, keys.used_uids).collect_until(4, timeout_s=10)
    assert len(before_crash.uids) == 4
    # The same consumer name after a restart: its pending entries come back first.
    restarted = trajectory_queue(redis, keys, "learner-0")
    batch = await TrajectoryCollector(restarted, keys.used_uids).collect_until(4, timeout_s=10)
    assert batch.uids == before_crash.uids


async def test_poison_messages_go_to_dead_letters_and_do_not_block(redis, keys):
    metrics = QueueMetrics()
    q = prompt_queue(redis, keys, "replica-a", max_deliveries=1, claim_idle_ms=0, metrics=metrics)
    await q.ensure_group()
    await redis.xadd(keys.prompts, {b"p": b"\xff\xfe not a protobuf"})
    await redis.xadd(keys.prompts, {b"x": b"no payload field"})
    await q.put(tasks(1, prefix="ok"))
    got = await q.claim(10)
    assert [d.message.uid for d in got] == ["ok0"]
    dead = await redis.xrange(keys.dead_letters)
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert reasons[0].startswith("undecodable: not a PromptTask") and reasons[1].startswith("malformed")
    assert dead[0][1][b"stream"].decode() == keys.prompts
    # Handed out again without an ack: the second delivery exceeds max_deliveries=1.
    other = prompt_queue(redis, keys, "replica-b", max_deliveries=1, claim_idle_ms=0, metrics=metrics)
    assert await other.claim(10) == []
    dead = await redis.xrange(keys.dead_letters)
    assert dead[-1][1][b"reason"].decode().startswith("redelivered: handed out 2 times")
    assert await q.length() == 0
    assert metrics.dead_lettered.labels("prompts", "undecodable")._value.get() == 1
    assert metrics.dead_lettered.labels("prompts", "redelivered")._value.get() == 1


async def test_a_full_stream_refuses_whole_batches_and_trims_nothing(redis, keys):
    q = prompt_queue(redis, keys, "learner", maxlen=5)
    await q.ensure_group()
    await q.put(tasks(3))
    with pytest.raises(
        QueueFullError, match=r"holds 3 unfinished entries; adding 3 would exceed its bound of 5"
    ):
        await q.put(tasks(3, prefix="x"))
    assert await q.length() == 3
    got = await q.claim(3)
    assert [d.message.uid for d in got] == ["t0", "t1", "t2"]
    await q.ack([d.entry_id for d in got])
    await q.put(tasks(5, prefix="y"))
    assert await q.length() == 5


async def test_two_runs_on_one_redis_never_see_each_other(redis):
    run_a, run_b = RunKeys("run-a-ns"), RunKeys("run-b-ns")
    qa, qb = prompt_queue(redis, run_a, "c"), prompt_queue(redis, run_b, "c")
    await qa.ensure_group()
    await qb.ensure_group()
    await qa.put(tasks(2))
    assert await qb.claim(10) == []
    assert len(await qa.claim(10)) == 2
    for key in await redis.keys("rlmesh:*ns*"):
        assert b"{run-a-ns}" in key or b"{run-b-ns}" in key


def test_run_ids_are_validated():
    with pytest.raises(ValueError, match="run id 'bad id'"):
        RunKeys("bad id")


async def test_registry_lists_live_replicas_and_drops_silent_ones_after_the_ttl(redis, keys):
    registry = ReplicaRegistry(redis, keys, ttl_s=0.5)
    await registry.register(
        trajectory_pb2.ReplicaRegistration(replica_id="r1", grpc_address="127.0.0.1:1", capacity=8)
    )
    long_lived = ReplicaRegistry(redis, keys, ttl_s=60)
    await long_lived.register(trajectory_pb2.ReplicaRegistration(replica_id="r2", grpc_address="127.0.0.1:2"))
    live = await registry.live()
    assert (
        [r.replica_id for r in live] == ["r1", "r2"]
        and live[0].capacity == 8
        and live[0].heartbeat_unix_ms > 0
    )
    assert 0 < await redis.pttl(keys.replica("r1")) <= 500
    deadline = time.monotonic() + 10
    while [r.replica_id for r in await registry.live()] != ["r2"]:
        assert time.monotonic() < deadline, "r1 never expired"
    assert await redis.smembers(keys.replicas) == {b"r2"}
    await long_lived.deregister("r2")
    assert await registry.live() == []


async def test_released_tasks_are_taken_over_at_once_with_their_delivery_count(redis, keys):
    producer = prompt_queue(redis, keys, "learner")
    a = prompt_queue(redis, keys, "replica-a", claim_idle_ms=600_000)
    b = prompt_queue(redis, keys, "replica-b", claim_idle_ms=600_000)
    await a.ensure_group()
    await producer.put(tasks(3))
    got = await a.claim(3)
    assert await b.claim(3) == []  # held by a, and far from idle
    await a.release([d.entry_id for d in got[:2]])
    taken = await b.claim(3)
    assert [d.message.uid for d in taken] == ["t0", "t1"]
    assert [d.deliveries for d in taken] == [2, 2]  # a's delivery, then b's: release adds none
