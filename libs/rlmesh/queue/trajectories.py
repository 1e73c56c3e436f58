"""The learner's side of the trajectory stream: batches with every uid at most once, and a
commit that marks their uids used and acks them in one transaction.
docs/reliability.md#trajectories-exactly-once-in-effect"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlmesh.queue.streams import StreamQueue
from rlmesh.v1 import trajectory_pb2

Trajectory = trajectory_pb2.Trajectory


@dataclass
class CollectedBatch:
    trajectories: list[Trajectory] = field(default_factory=list)
    entry_ids: list[bytes] = field(default_factory=list)
    duplicates: int = 0

    @property
    def uids(self) -> list[str]:
        return [t.uid for t in self.trajectories]


class TrajectoryCollector:
    def __init__(self, queue: StreamQueue[Trajectory], used_uids_key: str) -> None:
        self.queue = queue
        self.redis = queue.redis
        self.used_uids_key = used_uids_key

    async def collect(self, batch: CollectedBatch, want: int, block_ms: int = 1000) -> CollectedBatch:
        """Adds up to ``want - len(batch)`` new, unique trajectories to ``batch`` (one claim round)."""
        missing = want - len(batch.trajectories)
        if missing <= 0:
            return batch
        deliveries = await self.queue.claim(missing, block_ms=block_ms)
        if not deliveries:
            return batch
        used = await self.redis.smismember(self.used_uids_key, [d.message.uid for d in deliveries])
        in_batch = set(batch.uids)
        redundant: list[bytes] = []
        for delivery, already_used in zip(deliveries, used, strict=True):
            uid = delivery.message.uid
            if already_used or uid in in_batch:
                redundant.append(delivery.entry_id)
                continue
            in_batch.add(uid)
            batch.trajectories.append(delivery.message)
            batch.entry_ids.append(delivery.entry_id)
        if redundant:
            # Safe to ack now: the uid is already trained on, or its first copy is held in this batch.
            batch.duplicates += len(redundant)
            await self.queue.ack(redundant)
        return batch

    async def collect_until(self, want: int, timeout_s: float, block_ms: int = 500) -> CollectedBatch:
        """Collects until ``want`` trajectories or ``timeout_s``; returns what it has either way."""
        batch = CollectedBatch()
        deadline = time.monotonic() + timeout_s
        while len(batch.trajectories) < want and time.monotonic() < deadline:
            await self.collect(batch, want, block_ms=block_ms)
        return batch

    async def commit(self, batch: CollectedBatch) -> None:
        """Marks the batch's uids used and acks its entries, atomically."""
        await self.commit_ids(batch.uids, batch.entry_ids)

    async def commit_ids(
        self, uids: list[str], entry_ids: list[bytes], forget_uids: Sequence[str] = ()
    ) -> None:
        """Marks ``uids`` used and acks ``entry_ids``, atomically; ``forget_uids`` (uids no copy of
        can be taken any more) leave the used set in the same transaction, so it stays bounded."""
        if not uids and not entry_ids and not forget_uids:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            if forget_uids:
                pipe.srem(self.used_uids_key, *forget_uids)
            if uids:
                pipe.sadd(self.used_uids_key, *uids)
            if entry_ids:
                pipe.xack(self.queue.stream, self.queue.group, *entry_ids)
                pipe.xdel(self.queue.stream, *entry_ids)
            await pipe.execute()
        # Acked here, not through queue.ack: the queue must stop counting them as held.
        self.queue.forget(entry_ids)
        if self.queue.metrics:
            self.queue.metrics.acked.labels(self.queue._label).inc(len(entry_ids))

    async def used(self, uids: list[str]) -> list[bool]:
        return [bool(x) for x in await self.redis.smismember(self.used_uids_key, uids)] if uids else []
