"""Redis Streams queues: prompt tasks in, trajectories out, nothing lost; the replica registry."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from rlmesh.queue.connection import RedisAccessError, access_refusal, connect, retry_redis_with_deadline
from rlmesh.queue.keys import RunKeys
from rlmesh.queue.registry import ReplicaRegistry
from rlmesh.queue.streams import Delivery, QueueFullError, QueueMetrics, StreamQueue
from rlmesh.queue.trajectories import CollectedBatch, TrajectoryCollector
from rlmesh.v1 import trajectory_pb2

ROLLOUT_GROUP = "rollout"
LEARNER_GROUP = "learner"


def prompt_queue(
    redis: aioredis.Redis, keys: RunKeys, consumer: str, **kw: Any
) -> StreamQueue[trajectory_pb2.PromptTask]:
    """The prompt stream: the learner puts, rollout replicas claim as the ``rollout`` group.
    Keyword arguments (maxlen, max_deliveries, claim_idle_ms, metrics) go to ``StreamQueue``; the
    signer is ``keys.signer``."""
    return _run_stream(redis, keys.prompts, ROLLOUT_GROUP, consumer, trajectory_pb2.PromptTask, keys, kw)


def trajectory_queue(
    redis: aioredis.Redis, keys: RunKeys, consumer: str, **kw: Any
) -> StreamQueue[trajectory_pb2.Trajectory]:
    """The trajectory stream: rollout replicas put, the learner claims as the ``learner`` group."""
    return _run_stream(redis, keys.trajectories, LEARNER_GROUP, consumer, trajectory_pb2.Trajectory, keys, kw)


def _run_stream(
    redis: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    message_type: Any,
    keys: RunKeys,
    kw: dict[str, Any],
) -> Any:
    kw.setdefault("maxlen", 100_000)
    kw.setdefault("signer", keys.signer)  # the run's entries are signed when its keys carry a signer
    return StreamQueue(
        redis, stream, group, consumer, message_type, dead_letter_stream=keys.dead_letters, **kw
    )


__all__ = [
    "LEARNER_GROUP",
    "ROLLOUT_GROUP",
    "CollectedBatch",
    "Delivery",
    "QueueFullError",
    "QueueMetrics",
    "RedisAccessError",
    "ReplicaRegistry",
    "RunKeys",
    "StreamQueue",
    "TrajectoryCollector",
    "access_refusal",
    "connect",
    "prompt_queue",
    "retry_redis_with_deadline",
    "trajectory_queue",
]
