"""Prometheus series of the reward scoring core."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rlmesh.runtime.prometheus import BATCH_BUCKETS, MetricSet

SCORE_BUCKETS = (-10.0, -5.0, -2.0, -1.0, -0.5, -0.1, 0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0)
SECONDS_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


class RewardMetrics:
    """The reward core's series, registered into the service's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        series = MetricSet(registry)
        self.samples = series.counter(
            "rlmesh_reward_samples", "samples scored (with or without error), by function", ["function"]
        )
        self.errors = series.counter(
            "rlmesh_reward_sample_errors",
            "samples that could not be scored, by reason and function",
            ["reason", "function"],
        )
        self.scores = series.histogram(
            "rlmesh_reward_score",
            "scores of samples scored without error",
            ["function"],
            buckets=SCORE_BUCKETS,
        )
        self.function_seconds = series.histogram(
            "rlmesh_reward_function_seconds",
            "time one reward function call took",
            ["function"],
            buckets=SECONDS_BUCKETS,
        )
        self.batch_size = series.histogram(
            "rlmesh_reward_batch_size", "samples per scoring call", buckets=BATCH_BUCKETS
        )
        self.waiting = series.gauge(
            "rlmesh_reward_calls_waiting", "scoring calls waiting for the concurrency limit"
        )
