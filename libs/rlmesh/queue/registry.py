"""The replica registry: each replica's ``ReplicaRegistration`` under a key with a TTL its heartbeat
renews; with the run's signer every entry is signed, and ``live`` lists only the entries it vouches
for whose addresses have a service's form (docs/security.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from redis.exceptions import RedisError

from rlmesh.config.address_checks import check_engine_url, check_peer_address
from rlmesh.queue.keys import RunKeys
from rlmesh.queue.signing import INVALID, UNDECODABLE, UNTRUSTED, unwrap, wrap
from rlmesh.v1 import trajectory_pb2

log = logging.getLogger("rlmesh.queue")

WHAT = "registry"


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
        key = self.keys.replica(registration.replica_id)
        value = wrap(self.keys.signer, key, registration.SerializeToString())
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(key, value, px=self.ttl_ms)
            pipe.sadd(self.keys.replicas, registration.replica_id)
            await pipe.execute()

    async def deregister(self, replica_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.replica(replica_id))
            pipe.srem(self.keys.replicas, replica_id)
            await pipe.execute()

    async def live(self) -> list[trajectory_pb2.ReplicaRegistration]:
        """Replicas whose registration has not expired, by id; prunes expired ids from the index.
        An entry that is unsigned or signed with another key (with a signer), undecodable, or whose
        addresses are not addresses is skipped and counted in ``UNTRUSTED``, never raised."""
        raw_ids = sorted(await self.redis.smembers(self.keys.replicas))
        ids = [i for i in raw_ids if _replica_id(i) is not None]
        # Not a replica's: no replica can remove it, so the index is cleaned of it here.
        junk = [i for i in raw_ids if _replica_id(i) is None]
        if junk:
            UNTRUSTED.count(WHAT, INVALID, f"{self.keys.replicas} lists {len(junk)} id(s) no replica has")
            await self.redis.srem(self.keys.replicas, *junk)
        if not ids:
            return []
        values = await self.redis.mget([self.keys.replica(i.decode()) for i in ids])
        alive, expired = [], []
        for rid, value in zip(ids, values, strict=True):
            if value is None:
                expired.append(rid)
                continue
            registration = self._trusted(rid.decode(), value)
            if registration is not None:
                alive.append(registration)
        if expired:
            await self.redis.srem(self.keys.replicas, *expired)
        return alive

    def _trusted(self, replica_id: str, value: bytes) -> trajectory_pb2.ReplicaRegistration | None:
        key = self.keys.replica(replica_id)
        payload = unwrap(self.keys.signer, key, value, WHAT)
        if payload is None:
            return None
        try:
            registration = trajectory_pb2.ReplicaRegistration.FromString(payload)
        except DecodeError as e:
            UNTRUSTED.count(WHAT, UNDECODABLE, f"{key} is not a ReplicaRegistration: {e}")
            return None
        problem = registration_problem(registration, replica_id)
        if problem is not None:
            UNTRUSTED.count(WHAT, INVALID, f"{key}: {problem}")
            return None
        return registration

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


def registration_problem(registration: trajectory_pb2.ReplicaRegistration, replica_id: str) -> str | None:
    """What is wrong with a registration stored under ``replica_id``, or None. An empty engine URL
    is allowed (a replica listed without an engine: nothing is pushed to it)."""
    if registration.replica_id != replica_id:
        return f"names replica {registration.replica_id!r}"
    try:
        check_peer_address(registration.grpc_address)
        if registration.engine_url:
            check_engine_url(registration.engine_url)
    except ValueError as e:
        return str(e)
    return None


def _replica_id(raw: bytes) -> str | None:
    """``raw`` as a replica id when it names a key of the run (text, no control characters)."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return None
    return text if text and text.isprintable() and len(text) <= 256 else None
