"""The one way the services declare their Prometheus series: ``MetricSet`` binds a registry once,
and the bucket tuples more than one service uses are defined here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Items per call (samples, sequences): powers of two, so any batch size lands near a bound.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

LabelValues = str | Sequence[str]
CounterOrGauge = TypeVar("CounterOrGauge", Counter, Gauge)


class MetricSet:
    """Makes counters, gauges and histograms in ``registry``.

    ``registry=None`` makes them unregistered (tests, several queues in one process); passing it
    on every series is what keeps one from landing in prometheus_client's process-wide default
    registry by omission. ``zero`` lists label values whose series exist from the start at 0, so a
    rule on ``increase()`` sees the first event; a series is one value or a tuple of them."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.registry = registry

    def counter(
        self, name: str, documentation: str, labels: Sequence[str] = (), *, zero: Iterable[LabelValues] = ()
    ) -> Counter:
        return _with_zeros(Counter(name, documentation, labels, registry=self.registry), zero)

    def gauge(
        self, name: str, documentation: str, labels: Sequence[str] = (), *, zero: Iterable[LabelValues] = ()
    ) -> Gauge:
        return _with_zeros(Gauge(name, documentation, labels, registry=self.registry), zero)

    def histogram(
        self, name: str, documentation: str, labels: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)


def _with_zeros(metric: CounterOrGauge, zero: Iterable[LabelValues]) -> CounterOrGauge:
    for values in zero:
        metric.labels(*((values,) if isinstance(values, str) else values))
    return metric
