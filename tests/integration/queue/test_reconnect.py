"""Connection loss: a killed client connection and a restarted Redis (AOF on) lose nothing and
deliver nothing to the learner's batch twice."""

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from rlmesh.queue import (
    RunKeys,
    TrajectoryCollector,
    connect,
    prompt_queue,
    retry_redis_with_deadline,
    trajectory_queue,
)
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.net import free_port
from rlmesh.v1 import trajectory_pb2


def trajs(start, stop):
    return [trajectory_pb2.Trajectory(uid=f"g{i}/0", response_ids=[i]) for i in range(start, stop)]


async def test_killed_client_connections_reconnect_and_carry_on(redis_server, redis, keys):
    q = prompt_queue(redis, keys, "replica")
    await q.ensure_group()
    await q.put([trajectory_pb2.PromptTask(uid="a")])
    # Another client kills every other connection: the queue's next command must reconnect.
    admin = connect(redis_server.url)
    killed = await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    await admin.aclose()
    assert killed >= 1
    got = await q.claim(5)
    assert [d.message.uid for d in got] == ["a"]
    await q.ack([d.entry_id for d in got])
    assert await q.length() == 0


async def test_redis_restart_loses_nothing_and_duplicates_nothing(tmp_path):
    keys = RunKeys("restart-test")
    with ProcessLauncher(tmp_path, stop_grace_s=10) as launcher:
        server = launcher.start_redis(name="redis")
        redis = connect(server.url)
        try:
            producer = trajectory_queue(redis, keys, "replica")
            learner = trajectory_queue(redis, keys, "learner-0")
            await learner.ensure_group()
            collector = TrajectoryCollector(learner, keys.used_uids)
            await producer.put(trajs(0, 6))
            batch = await collector.collect_until(3, timeout_s=10)
            assert batch.uids == ["g0/0", "g1/0", "g2/0"]

            assert launcher.stop(server.process) == 0  # SIGTERM: Redis flushes its AOF and exits
            with pytest.raises(Exception):  # noqa: B017 - any connection error: Redis is down
                await redis.ping()
            launcher.start_redis(name="redis", port=server.port)  # same port, same data dir

            # The producer carries on after the restart; the learner finishes its batch.
            await retry_redis_with_deadline(
                lambda: producer.put(trajs(6, 8)), "put after restart", deadline_s=30
            )
            await retry_redis_with_deadline(
                lambda: collector.collect(batch, 8), "collect after restart", deadline_s=30
            )
            while len(batch.uids) < 8:
                await collector.collect(batch, 8, block_ms=200)
            assert sorted(batch.uids) == sorted(f"g{i}/0" for i in range(8))
            assert len(set(batch.uids)) == 8
            await collector.commit(batch)
            assert await learner.length() == 0
            # Trajectories published again after the restart (a retried publish) are dropped.
            await producer.put(trajs(0, 2))
            late = await collector.collect_until(1, timeout_s=1)
            assert late.uids == [] and late.duplicates == 2
        finally:
            await redis.aclose()


async def test_retries_against_a_redis_that_never_comes_back_give_up_at_the_deadline():
    client = connect(f"redis://127.0.0.1:{free_port()}/0", retries=0)  # nothing listens there
    pings = 0

    async def ping() -> bool:
        nonlocal pings
        pings += 1
        return await client.ping()

    try:
        with pytest.raises(RedisConnectionError, match=r"^ping: Redis unreachable for \d+ s: "):
            await retry_redis_with_deadline(ping, "ping", deadline_s=1)
        assert pings > 1  # backed off and tried again before giving up
    finally:
        await client.aclose()
