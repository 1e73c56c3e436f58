"""Prometheus series of the reference service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from rlmesh.runtime.busy import BusySecondsCollector, BusyTracker

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
COMPUTE_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ReferenceMetrics:
    def __init__(self, registry: CollectorRegistry, busy: BusyTracker) -> None:
        self.samples = Counter("rlmesh_reference_samples", "samples answered", registry=registry)
        self.tokens = Counter(
            "rlmesh_reference_tokens", "prompt + response tokens of samples answered", registry=registry
        )
        self.padded_tokens = Counter(
            "rlmesh_reference_padded_tokens", "tokens forwarded, padding included", registry=registry
        )
        self.batch_size = Histogram(
            "rlmesh_reference_batch_size",
            "samples per LogProbs call answered (its count: the calls)",
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.micro_batches = Counter("rlmesh_reference_micro_batches", "forward passes", registry=registry)
        self.compute_seconds = Histogram(
            "rlmesh_reference_compute_seconds",
            "time to compute one call's log-probs",
            buckets=COMPUTE_SECONDS_BUCKETS,
            registry=registry,
        )
        # Calls overlap (they queue for the model), so the histogram's sum is no busy time: this is.
        registry.register(
            BusySecondsCollector(
                busy, "rlmesh_reference_busy_seconds", "wall seconds with at least one forward running"
            )
        )
