"""The engine's Prometheus metrics, served at /metrics in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from rlmesh.engine.batching import BatchEngine
from rlmesh.runtime.prometheus import BATCH_BUCKETS, MetricSet

# Every weight-update series exists from the start at 0, so a rule on increase() sees the first failure.
WEIGHT_UPDATES = (("distributed", "ok"), ("distributed", "failed"), ("disk", "ok"), ("disk", "failed"))


class EngineMetrics:
    def __init__(self) -> None:
        # Not the default registry: one process may build several apps (tests), each counting its own.
        self.registry = CollectorRegistry()
        series = MetricSet(self.registry)
        self.requests = series.counter("rlmesh_engine_requests", "/generate requests finished", ["finish"])
        self.tokens = series.counter("rlmesh_engine_generated_tokens", "Tokens generated")
        self.prompt_tokens = series.counter("rlmesh_engine_prompt_tokens", "Prompt tokens prefilled")
        self.batch_size = series.histogram(
            "rlmesh_engine_generate_batch_size",
            "sequences per /generate call answered (its count: the calls)",
            buckets=BATCH_BUCKETS,
        )
        self.latency = series.histogram(
            "rlmesh_engine_request_latency_seconds",
            "/generate latency",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.running = series.gauge("rlmesh_engine_running_sequences", "Sequences decoding now")
        self.busy = series.gauge("rlmesh_engine_busy_seconds", "Seconds spent in model forwards since start")
        self.waiting = series.gauge("rlmesh_engine_waiting_sequences", "Sequences waiting for a batch slot")
        self.weight_updates = series.counter(
            "rlmesh_engine_weight_updates", "Weight updates", ["source", "outcome"], zero=WEIGHT_UPDATES
        )

    def scrape(self, engine: BatchEngine) -> str:
        """The exposition text, with the gauges read from ``engine`` now."""
        self.running.set(engine.running)
        self.waiting.set(engine.waiting)
        self.busy.set(engine.busy_s)
        return generate_latest(self.registry).decode()
