"""A finished run's keys expire: Redis is not an archive, and a long-lived shared Redis must not
fill up with the streams of every run it ever carried. The checkpoints on disk stay."""

from __future__ import annotations

import redis.asyncio as aioredis

from rlmesh.queue.keys import RunKeys


async def expire_run_keys(redis: aioredis.Redis, keys: RunKeys, ttl_s: int) -> int:
    """Sets a ``ttl_s`` expiry on every key of the run that has none (a replica's registration
    keeps its shorter heartbeat TTL); returns how many keys it set. ``ttl_s`` <= 0: none."""
    if ttl_s <= 0:
        return 0
    # SCAN, unlike KEYS, never blocks the server on a big keyspace. A run id has no glob characters,
    # and the hash tag's closing brace keeps run "a" from matching run "a:b".
    count = 0
    async for key in redis.scan_iter(match=f"{keys.prefix}:*", count=500):
        count += int(await redis.expire(key, ttl_s, nx=True))
    return count
