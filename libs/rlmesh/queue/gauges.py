"""The run's queues and replica registry as Prometheus gauges, read from Redis: stream lengths,
entries in work, dead letters and live replicas. docs/monitoring.md#what-exports-what"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Gauge
from redis.exceptions import ResponseError

from rlmesh.queue.keys import RunKeys

_PREFIX, _SUFFIXES = "rlmesh:{", (":prompts", ":trajectories")


def keys_of_stream(stream: str) -> RunKeys | None:
    """The run whose prompt or trajectory stream ``stream`` is (``RunKeys`` inverted), or None."""
    for suffix in _SUFFIXES:
        if stream.startswith(_PREFIX) and stream.endswith("}" + suffix):
            run_id = stream[len(_PREFIX) : -len(suffix) - 1]
            try:
                keys = RunKeys(run_id)
            except ValueError:
                return None
            return keys if stream in (keys.prompts, keys.trajectories) else None
    return None


@dataclass(frozen=True)
class WatchedStream:
    key: str
    group: str  # the consumer group whose pending entries count as "in work"

    @property
    def label(self) -> str:
        return self.key.rsplit(":", 1)[-1]  # "prompts", "trajectories": as QueueMetrics labels them


class RunQueueGauges:
    """``refresh()`` reads the run's state from Redis into the gauges; call it periodically.

    No process's own counter can show these: a stream's depth is every producer's and consumer's
    work together, and a replica that died cannot report its own absence."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RunKeys,
        streams: Sequence[WatchedStream],
        registry: CollectorRegistry | None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.streams = list(streams)
        self.length = Gauge(
            "rlmesh_queue_length",
            "entries in the run's stream now (waiting or in work; 'dead': dead letters kept)",
            ["stream"],
            registry=registry,
        )
        self.pending = Gauge(
            "rlmesh_queue_pending",
            "entries handed to a consumer of the stream's group and not yet acknowledged",
            ["stream"],
            registry=registry,
        )
        self.replicas = Gauge(
            "rlmesh_replicas_registered",
            "rollout replicas whose registration in the run's registry has not expired",
            registry=registry,
        )
        # Every series exists from the start at 0: an alert on a rise sees the first one.
        for stream in self.streams:
            self.length.labels(stream.label)
            self.pending.labels(stream.label)
        self.length.labels("dead")

    async def refresh(self) -> None:
        """One read of every stream and the registry (one round trip); raises Redis errors."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in self.streams:
                pipe.xlen(stream.key)
                pipe.xpending(stream.key, stream.group)
            pipe.xlen(self.keys.dead_letters)
            pipe.smembers(self.keys.replicas)
            # A group the consumer has not created yet answers NOGROUP: nothing is in work then.
            replies = await pipe.execute(raise_on_error=False)
        for i, stream in enumerate(self.streams):
            length, pending = replies[2 * i], replies[2 * i + 1]
            if isinstance(length, Exception):
                raise length
            self.length.labels(stream.label).set(int(length))
            if isinstance(pending, ResponseError) and "NOGROUP" in str(pending):
                pending = {"pending": 0}
            elif isinstance(pending, Exception):
                raise pending
            self.pending.labels(stream.label).set(int(pending["pending"]))
        dead, ids = replies[-2], replies[-1]
        for reply in (dead, ids):
            if isinstance(reply, Exception):
                raise reply
        self.length.labels("dead").set(int(dead))
        self.replicas.set(await self._live(sorted(ids)))

    async def _live(self, ids: list[bytes]) -> int:
        # Read-only: the index may hold ids whose registration expired; the learner prunes them.
        if not ids:
            return 0
        # An id that is not text (written by something else) must not end the refresh.
        values = await self.redis.mget([self.keys.replica(i.decode(errors="replace")) for i in ids])
        return sum(v is not None for v in values)
