"""A finished run's keys get an expiry; another run's keys, and a registration's shorter TTL, stay."""

from rlmesh.queue.keys import RunKeys
from rlmesh.queue.retention import expire_run_keys


async def test_a_finished_runs_keys_expire_and_nothing_else_changes(redis, keys):
    other = RunKeys(keys.run_id + ":b")  # shares the prefix up to the brace
    await redis.xadd(keys.prompts, {"t": b"1"})
    await redis.sadd(keys.used_uids, "u1")
    await redis.set(keys.replica("r0"), b"reg", px=15_000)
    await redis.xadd(other.prompts, {"t": b"1"})

    assert await expire_run_keys(redis, keys, 3600) == 2
    assert 3500 < await redis.ttl(keys.prompts) <= 3600
    assert 3500 < await redis.ttl(keys.used_uids) <= 3600
    assert await redis.pttl(keys.replica("r0")) <= 15_000  # the heartbeat TTL is kept
    assert await redis.ttl(other.prompts) == -1
    assert await expire_run_keys(redis, keys, 0) == 0
