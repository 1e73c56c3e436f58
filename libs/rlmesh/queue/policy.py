"""The run's current policy in Redis: the version the learner last confirmed, and where a disk
snapshot of it lives, so a replica joining mid-run loads it before taking work."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from rlmesh.queue.keys import RunKeys


@dataclass
class PolicyState:
    version: int
    disk_path: str | None


async def read_policy(redis: aioredis.Redis, keys: RunKeys) -> PolicyState:
    raw = await redis.hgetall(keys.scoped("policy"))
    version = int(raw.get(b"version", b"0"))
    path = raw.get(b"disk_path")
    return PolicyState(version=version, disk_path=path.decode() if path else None)


async def publish_policy(
    redis: aioredis.Redis, keys: RunKeys, version: int, disk_path: str | None = None
) -> None:
    mapping: dict[str, str | int] = {"version": version}
    if disk_path:
        mapping["disk_path"] = disk_path
    await redis.hset(keys.scoped("policy"), mapping=mapping)
