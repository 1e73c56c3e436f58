"""Prometheus series of the reward scoring core."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SCORE_BUCKETS = (-10.0, -5.0, -2.0, -1.0, -0.5, -0.1, 0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SECONDS_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


class RewardMetrics:
    """The reward core's series, registered into the service's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.samples = Counter(
            "rlmesh_reward_samples",
            "samples scored (with or without error), by function",
            ["function"],
            registry=registry,
        )
        self.errors = Counter(
            "rlmesh_reward_sample_errors",
            "samples that could not be scored, by reason and function",
            ["reason", "function"],
            registry=registry,
        )
        self.scores = Histogram(
            "rlmesh_reward_score",
            "scores of samples scored without error",
            ["function"],
            buckets=SCORE_BUCKETS,
            registry=registry,
        )
        self.function_seconds = Histogram(
            "rlmesh_reward_function_seconds",
            "time one reward function call took",
            ["function"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "rlmesh_reward_batch_size", "samples per scoring call", buckets=BATCH_BUCKETS, registry=registry
        )
        self.waiting = Gauge(
            "rlmesh_reward_calls_waiting",
            "scoring calls waiting for the concurrency limit",
            registry=registry,
        )
