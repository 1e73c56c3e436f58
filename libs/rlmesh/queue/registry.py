"""The replica registry: each rollout replica's ``ReplicaRegistration`` under a key with a TTL
that its heartbeat renews. A replica that stops heartbeating drops out within the TTL."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rlmesh.queue.keys import RunKeys
from rlmesh.v1 import trajectory_pb2

log = logging.getLogger("rlmesh.queue")


class ReplicaRegistry:
    def __init__(self, redis: aioredis.Redis, keys: RunKeys, ttl_s: float = 15.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"heartbeat TTL must be > 0 s, got {ttl_s}")
        self.redis = redis
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)

    async def register(self, registration: trajectory_pb2.ReplicaRegistration) -> None:
        """Registers or renews (a heartbeat is a register); stamps ``heartbeat_unix_ms``."""
        if not registration.replica_id:
            raise ValueError("ReplicaRegistration.replica_id is empty")
        registration.heartbeat_unix_ms = int(time.time() * 1000)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(
                self.keys.replica(registration.replica_id), registration.SerializeToString(), px=self.ttl_ms
            )
            pipe.sadd(self.keys.replicas, registration.replica_id)
            await pipe.execute()

    async def deregister(self, replica_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.replica(replica_id))
            pipe.srem(self.keys.replicas, replica_id)
            await pipe.execute()

    async def live(self) -> list[trajectory_pb2.ReplicaRegistration]:
        """Replicas whose registration has not expired, by id; prunes expired ids from the index."""
        ids = sorted(await self.redis.smembers(self.keys.replicas))
        if not ids:
            return []
        values = await self.redis.mget([self.keys.replica(i.decode()) for i in ids])
        alive, expired = [], []
        for rid, value in zip(ids, values, strict=True):
            if value is None:
                expired.append(rid)
            else:
                alive.append(trajectory_pb2.ReplicaRegistration.FromString(value))
        if expired:
            await self.redis.srem(self.keys.replicas, *expired)
        return alive

    async def heartbeat_forever(
        self, current: Callable[[], trajectory_pb2.ReplicaRegistration], interval_s: float | None = None
    ) -> None:
        """Re-registers every ``interval_s`` (default a third of the TTL) until cancelled; a Redis
        outage is logged and ridden out, the next beat re-registers."""
        interval = interval_s if interval_s is not None else self.ttl_ms / 3000
        while True:
            try:
                await self.register(current())
            except (RedisError, OSError) as e:
                log.warning("heartbeat failed, retrying next beat: %s", e)
            await asyncio.sleep(interval)
