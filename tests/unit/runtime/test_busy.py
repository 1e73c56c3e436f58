"""BusyTracker (union of in-flight computations, merged bounded intervals) and union_seconds, on a
fake clock: no sleeps."""

import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rlmesh.runtime.busy import BusySecondsCollector, BusyTracker, union_seconds


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tracker(clock: FakeClock, **kwargs) -> BusyTracker:
    return BusyTracker(clock=clock, **kwargs)


def test_one_computation_is_one_interval():
    clock = FakeClock()
    t = tracker(clock)
    assert t.busy_s == 0.0 and t.intervals() == []
    with t.busy():
        clock.now += 2.0
        assert t.in_flight == 1
        assert t.busy_s == pytest.approx(2.0)  # the running one counts up to now
        assert t.intervals() == [(1000.0, 1002.0)]
    clock.now += 5.0
    assert t.in_flight == 0
    assert t.busy_s == pytest.approx(2.0)
    assert t.intervals() == [(1000.0, 1002.0)]


def test_overlapping_computations_count_once():
    clock = FakeClock()
    t = tracker(clock)
    first, second = t.busy(), t.busy()
    first.__enter__()  # 1000
    clock.now += 1.0
    second.__enter__()  # 1001
    clock.now += 1.0
    first.__exit__(None, None, None)  # 1002: still busy, the second runs
    assert t.in_flight == 1
    clock.now += 3.0
    second.__exit__(None, None, None)  # 1005
    assert t.busy_s == pytest.approx(5.0)  # not 2 + 4 = 6
    assert t.intervals() == [(1000.0, 1005.0)]


def test_nested_blocks_count_once():
    clock = FakeClock()
    t = tracker(clock)
    with t.busy():
        clock.now += 1.0
        with t.busy():
            clock.now += 1.0
        clock.now += 1.0
    assert t.busy_s == pytest.approx(3.0)
    assert t.intervals() == [(1000.0, 1003.0)]


def test_concurrent_threads_count_the_union():
    clock = FakeClock()
    t = tracker(clock)
    inside, release = threading.Barrier(5), threading.Event()

    def work() -> None:
        with t.busy():
            inside.wait()
            release.wait()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    inside.wait()  # all four are in flight, entered at 1000
    assert t.in_flight == 4
    clock.now += 3.0
    release.set()
    for th in threads:
        th.join()
    assert t.in_flight == 0
    assert t.busy_s == pytest.approx(3.0)
    assert t.intervals() == [(1000.0, 1003.0)]


def test_a_gap_under_merge_gap_extends_the_interval_but_not_busy_s():
    clock = FakeClock()
    t = tracker(clock, merge_gap_s=0.001)
    for _ in range(1000):  # an engine: 1000 decode steps of 10 ms, 0.1 ms apart
        with t.busy():
            clock.now += 0.010
        clock.now += 0.0001
    assert len(t.intervals()) == 1
    start, end = t.intervals()[0]
    assert start == 1000.0 and end == pytest.approx(1000.0 + 1000 * 0.0101 - 0.0001)
    assert t.busy_s == pytest.approx(10.0)  # the gaps are not busy time


def test_a_longer_gap_starts_a_new_interval():
    clock = FakeClock()
    t = tracker(clock)
    with t.busy():
        clock.now += 1.0
    clock.now += 0.5
    with t.busy():
        clock.now += 2.0
    assert t.intervals() == [(1000.0, 1001.0), (1001.5, 1003.5)]
    assert t.busy_s == pytest.approx(3.0)


def test_intervals_since_clips_and_drops_earlier_ones():
    clock = FakeClock()
    t = tracker(clock)
    for _ in range(3):  # 1000-1001, 1002-1003, 1004-1005
        with t.busy():
            clock.now += 1.0
        clock.now += 1.0
    assert t.intervals(since=1002.5) == [(1002.5, 1003.0), (1004.0, 1005.0)]
    assert t.intervals(since=1003.0) == [(1004.0, 1005.0)]
    assert t.intervals(since=2000.0) == []
    with t.busy():  # in progress: ends now
        clock.now += 0.25
        assert t.intervals(since=1005.5) == [(1006.0, 1006.25)]


def test_only_the_last_max_intervals_are_kept_but_busy_s_counts_all():
    clock = FakeClock()
    t = tracker(clock, max_intervals=3)
    for _ in range(5):
        with t.busy():
            clock.now += 1.0
        clock.now += 1.0
    assert t.intervals() == [(1004.0, 1005.0), (1006.0, 1007.0), (1008.0, 1009.0)]
    assert t.busy_s == pytest.approx(5.0)


def test_an_exception_still_ends_the_busy_period():
    clock = FakeClock()
    t = tracker(clock)
    with pytest.raises(RuntimeError), t.busy():
        clock.now += 1.0
        raise RuntimeError("forward failed")
    assert t.in_flight == 0
    assert t.intervals() == [(1000.0, 1001.0)]


def test_bad_arguments():
    with pytest.raises(ValueError):
        BusyTracker(merge_gap_s=-1)
    with pytest.raises(ValueError):
        BusyTracker(max_intervals=0)


def test_union_seconds_merges_lists_and_clips_to_the_window():
    engine_a = [(0.0, 4.0), (10.0, 12.0)]
    engine_b = [(3.0, 6.0)]
    reference = [(5.0, 7.0), (11.0, 11.5)]
    learner = [(20.0, 25.0)]
    lists = [engine_a, engine_b, reference, learner]
    assert union_seconds(lists, 0.0, 30.0) == pytest.approx(7.0 + 2.0 + 5.0)
    assert union_seconds(lists, 2.0, 22.0) == pytest.approx(5.0 + 2.0 + 2.0)
    assert union_seconds(lists, 7.0, 10.0) == 0.0
    assert union_seconds([], 0.0, 10.0) == 0.0
    assert union_seconds([[], [(1.0, 1.0)], [(5.0, 4.0)]], 0.0, 10.0) == 0.0  # empty, reversed
    assert union_seconds([[(0.0, 10.0)], [(2.0, 3.0)]], 0.0, 10.0) == pytest.approx(10.0)  # contained
    assert union_seconds([[(0.0, 1.0), (1.0, 2.0)]], 0.0, 10.0) == pytest.approx(2.0)  # touching
    assert union_seconds([[(0.0, 5.0)]], 8.0, 2.0) == 0.0  # empty window


def test_union_of_a_tracker_equals_its_busy_s_without_merged_gaps():
    clock = FakeClock()
    t = tracker(clock, merge_gap_s=0.0)
    for dt, gap in [(1.0, 0.5), (0.25, 2.0), (3.0, 0.0)]:
        with t.busy():
            clock.now += dt
        clock.now += gap
    assert union_seconds([t.intervals()], 0.0, clock.now) == pytest.approx(t.busy_s) == pytest.approx(4.25)


def test_the_collector_exposes_busy_s_as_a_counter():
    clock = FakeClock()
    t = tracker(clock)
    registry = CollectorRegistry()
    registry.register(BusySecondsCollector(t, "rlmesh_test_busy_seconds", "seconds busy"))
    with t.busy():
        clock.now += 1.5
    text = generate_latest(registry).decode()
    assert any(
        ln.startswith("# TYPE rlmesh_test_busy_seconds") and ln.endswith(" counter")
        for ln in text.splitlines()
    )
    assert "rlmesh_test_busy_seconds_total 1.5" in text
