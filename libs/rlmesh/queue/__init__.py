"""Redis Streams queues: prompt tasks in, trajectories out, nothing lost; the replica registry."""

from __future__ import annotations

import redis.asyncio as aioredis

from rlmesh.queue.client import connect, retry_forever
from rlmesh.queue.keys import RunKeys
from rlmesh.queue.registry import ReplicaRegistry
from rlmesh.queue.streams import Delivery, QueueFullError, QueueMetrics, StreamQueue
from rlmesh.queue.trajectories import CollectedBatch, TrajectoryCollector
from rlmesh.v1 import trajectory_pb2

ROLLOUT_GROUP = "rollout"
LEARNER_GROUP = "learner"


def prompt_queue(
    redis: aioredis.Redis,
    keys: RunKeys,
    consumer: str,
    *,
    maxlen: int = 100_000,
    max_deliveries: int = 3,
    claim_idle_ms: int = 60_000,
    metrics: QueueMetrics | None = None,
) -> StreamQueue[trajectory_pb2.PromptTask]:
    """The prompt stream: the learner puts, rollout replicas claim as the ``rollout`` group."""
    return StreamQueue(
        redis,
        keys.prompts,
        ROLLOUT_GROUP,
        consumer,
        trajectory_pb2.PromptTask,
        maxlen=maxlen,
        dead_letter_stream=keys.dead_letters,
        max_deliveries=max_deliveries,
        claim_idle_ms=claim_idle_ms,
        metrics=metrics,
    )


def trajectory_queue(
    redis: aioredis.Redis,
    keys: RunKeys,
    consumer: str,
    *,
    maxlen: int = 100_000,
    max_deliveries: int = 3,
    claim_idle_ms: int = 60_000,
    metrics: QueueMetrics | None = None,
) -> StreamQueue[trajectory_pb2.Trajectory]:
    """The trajectory stream: rollout replicas put, the learner claims as the ``learner`` group."""
    return StreamQueue(
        redis,
        keys.trajectories,
        LEARNER_GROUP,
        consumer,
        trajectory_pb2.Trajectory,
        maxlen=maxlen,
        dead_letter_stream=keys.dead_letters,
        max_deliveries=max_deliveries,
        claim_idle_ms=claim_idle_ms,
        metrics=metrics,
    )


__all__ = [
    "LEARNER_GROUP",
    "ROLLOUT_GROUP",
    "CollectedBatch",
    "Delivery",
    "QueueFullError",
    "QueueMetrics",
    "ReplicaRegistry",
    "RunKeys",
    "StreamQueue",
    "TrajectoryCollector",
    "connect",
    "prompt_queue",
    "retry_forever",
    "trajectory_queue",
]
