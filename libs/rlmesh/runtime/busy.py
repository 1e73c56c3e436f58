"""When a service is doing model compute, as wall-clock intervals that can be merged across processes.

docs/internals.md#rlmeshruntimebusy"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from prometheus_client.core import CounterMetricFamily

Interval = tuple[float, float]

DEFAULT_MERGE_GAP_S = 0.001
DEFAULT_MAX_INTERVALS = 100_000


class BusyTracker:
    """Thread-safe record of the periods with at least one computation in flight.

    Args:
        clock: wall-clock seconds (default ``time.time``; tests pass a fake one).
        merge_gap_s: a busy period starting less than this after the previous one ended extends
            it, so an engine decoding thousands of steps back to back keeps one interval, not
            thousands. ``intervals()`` therefore covers those short gaps; ``busy_s`` does not.
        max_intervals: how many intervals are kept; the oldest are dropped beyond it (``busy_s``
            still counts them).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        merge_gap_s: float = DEFAULT_MERGE_GAP_S,
        max_intervals: int = DEFAULT_MAX_INTERVALS,
    ) -> None:
        if merge_gap_s < 0:
            raise ValueError(f"merge_gap_s must be >= 0, got {merge_gap_s}")
        if max_intervals < 1:
            raise ValueError(f"max_intervals must be >= 1, got {max_intervals}")
        self._clock = clock
        self._merge_gap_s = merge_gap_s
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed: deque[Interval] = deque(maxlen=max_intervals)
        self._closed_s = 0.0  # busy seconds of every finished period, dropped intervals included
        self._period_start = 0.0  # when the current period began (in flight > 0)
        self._interval_start = 0.0  # start of the current interval (earlier when merged)

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Counts the enclosed block as model compute; safe to nest and to use from many threads."""
        self._enter()
        try:
            yield
        finally:
            self._exit()

    def _enter(self) -> None:
        with self._lock:
            self._in_flight += 1
            if self._in_flight > 1:
                return
            now = self._clock()
            self._period_start = self._interval_start = now
            if self._closed and now - self._closed[-1][1] < self._merge_gap_s:
                self._interval_start = self._closed.pop()[0]

    def _exit(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight > 0:
                return
            now = self._clock()
            self._closed_s += max(0.0, now - self._period_start)
            self._closed.append((self._interval_start, max(now, self._interval_start)))

    @property
    def in_flight(self) -> int:
        """Computations running now."""
        return self._in_flight

    @property
    def busy_s(self) -> float:
        """Total seconds with at least one computation in flight, the current one up to now."""
        with self._lock:
            if self._in_flight:
                return self._closed_s + max(0.0, self._clock() - self._period_start)
            return self._closed_s

    def intervals(self, since: float | None = None) -> list[Interval]:
        """Busy intervals ``(start, end)`` in clock seconds, oldest first, disjoint; the one in
        progress ends now. With ``since``, only the part of each interval after ``since``."""
        with self._lock:
            out = list(self._closed)
            if self._in_flight:
                out.append((self._interval_start, max(self._clock(), self._interval_start)))
        if since is None:
            return out
        return [(max(start, since), end) for start, end in out if end > since]


def union_seconds(intervals_lists: Iterable[Iterable[Interval]], start: float, end: float) -> float:
    """Seconds within ``[start, end]`` covered by at least one interval of any of the lists
    (several processes' ``BusyTracker.intervals()``): overlaps count once."""
    spans = sorted((max(a, start), min(b, end)) for intervals in intervals_lists for a, b in intervals)
    spans = [(a, b) for a, b in spans if b > a]
    if not spans:
        return 0.0
    covered = 0.0
    cur_start, cur_end = spans[0]
    for a, b in spans[1:]:
        if a > cur_end:
            covered += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    return covered + cur_end - cur_start


class BusySecondsCollector:
    """A Prometheus collector that exposes a tracker's ``busy_s`` as the counter ``<name>_total``::

    registry.register(BusySecondsCollector(tracker, "rlmesh_reference_busy_seconds", "..."))
    """

    def __init__(self, tracker: BusyTracker, name: str, documentation: str) -> None:
        self.tracker = tracker
        self.name = name
        self.documentation = documentation

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation, value=self.tracker.busy_s)]
