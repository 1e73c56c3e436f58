"""Prometheus series of the reference service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rlmesh.runtime.busy import BusySecondsCollector, BusyTracker
from rlmesh.runtime.prometheus import BATCH_BUCKETS, MetricSet

COMPUTE_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ReferenceMetrics:
    def __init__(self, registry: CollectorRegistry, busy: BusyTracker) -> None:
        series = MetricSet(registry)
        self.samples = series.counter("rlmesh_reference_samples", "samples answered")
        self.tokens = series.counter(
            "rlmesh_reference_tokens", "prompt + response tokens of samples answered"
        )
        self.padded_tokens = series.counter(
            "rlmesh_reference_padded_tokens", "tokens forwarded, padding included"
        )
        self.batch_size = series.histogram(
            "rlmesh_reference_batch_size",
            "samples per LogProbs call answered (its count: the calls)",
            buckets=BATCH_BUCKETS,
        )
        self.micro_batches = series.counter("rlmesh_reference_micro_batches", "forward passes")
        self.compute_seconds = series.histogram(
            "rlmesh_reference_compute_seconds",
            "time to compute one call's log-probs",
            buckets=COMPUTE_SECONDS_BUCKETS,
        )
        # Calls overlap (they queue for the model), so the histogram's sum is no busy time: this is.
        registry.register(
            BusySecondsCollector(
                busy, "rlmesh_reference_busy_seconds", "wall seconds with at least one forward running"
            )
        )
