"""The engine's Prometheus metrics, served at /metrics in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rlmesh.engine.batching import BatchEngine

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class EngineMetrics:
    def __init__(self) -> None:
        # Not the default registry: one process may build several apps (tests), each counting its own.
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "rlmesh_engine_requests", "/generate requests finished", ["finish"], registry=registry
        )
        self.tokens = Counter("rlmesh_engine_generated_tokens", "Tokens generated", registry=registry)
        self.prompt_tokens = Counter(
            "rlmesh_engine_prompt_tokens", "Prompt tokens prefilled", registry=registry
        )
        self.batch_size = Histogram(
            "rlmesh_engine_generate_batch_size",
            "sequences per /generate call answered (its count: the calls)",
            registry=registry,
            buckets=BATCH_BUCKETS,
        )
        self.latency = Histogram(
            "rlmesh_engine_request_latency_seconds",
            "/generate latency",
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.running = Gauge("rlmesh_engine_running_sequences", "Sequences decoding now", registry=registry)
        self.busy = Gauge(
            "rlmesh_engine_busy_seconds", "Seconds spent in model forwards since start", registry=registry
        )
        self.waiting = Gauge(
            "rlmesh_engine_waiting_sequences", "Sequences waiting for a batch slot", registry=registry
        )
        self.weight_updates = Counter(
            "rlmesh_engine_weight_updates", "Weight updates", ["source", "outcome"], registry=registry
        )
        # Every series exists from the start at 0, so a rule on increase() sees the first failure.
        for source in ("distributed", "disk"):
            for outcome in ("ok", "failed"):
                self.weight_updates.labels(source, outcome)

    def scrape(self, engine: BatchEngine) -> str:
        """The exposition text, with the gauges read from ``engine`` now."""
        self.running.set(engine.running)
        self.waiting.set(engine.waiting)
        self.busy.set(engine.busy_s)
        return generate_latest(self.registry).decode()
