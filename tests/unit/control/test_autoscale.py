"""The autoscaler's decisions on made-up readings, with a clock the test moves: the load's formula,
the bounds, the cool-downs, the scale-down window and the hold on a learner-bound run."""

from __future__ import annotations

import math

import pytest

from rlmesh.config.rlmesh_section import AutoscaleConfig
from rlmesh.control.autoscale import Autoscaler, FleetReading

CAP = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reading(live: int, outstanding: int, claimed: int, added: int, backlog: int = 0) -> FleetReading:
    return FleetReading(
        live=[f"r{i}" for i in range(live)],
        outstanding=outstanding,
        claimed=claimed,
        added_total=added,
        capacity=CAP,
        learner_backlog=backlog,
    )


def scaler(clock: Clock, **kw) -> Autoscaler:
    settings = {
        "min_replicas": 1,
        "max_replicas": 16,
        "scale_up_cooldown_s": 10.0,
        "scale_down_cooldown_s": 30.0,
        "scale_down_window_s": 60.0,
        "rate_window_s": 1e-9,  # rates without averaging: each decision reads its own interval
        "target_utilization": 0.5,
        "target_backlog_s": 10.0,
        **kw,
    }
    return Autoscaler(AutoscaleConfig(enabled=True, **settings), learner_backlog_limit=100, clock=clock)


def test_the_load_formula_serves_arrivals_with_room_and_clears_the_backlog():
    clock = Clock()
    a = scaler(clock, scale_up_cooldown_s=0)
    a.observe(reading(2, outstanding=8, claimed=8, added=100))
    clock.now += 10
    # 20 tasks arrived, the outstanding set grew by 4: 16 finished in 10 s with 8 claimed, so a
    # slot finishes 0.2/s and a replica of 4 slots 0.8/s; 2/s arriving at 50% is 5 replicas, the
    # 4 unclaimed cleared in 10 s half a replica more.
    d = a.observe(reading(2, outstanding=12, claimed=8, added=120))
    assert d.replica_tasks_per_s == pytest.approx(0.8)
    assert d.arrival_per_s == pytest.approx(2.0)
    assert d.wanted == math.ceil(2.0 / (0.8 * 0.5) + 4 / (0.8 * 10))
    assert d.desired == d.wanted and d.changed and d.before == 2


def test_before_any_task_finished_it_asks_a_slot_per_outstanding_task_within_the_bounds():
    clock = Clock()
    a = scaler(clock, max_replicas=5)
    d = a.observe(reading(1, outstanding=13, claimed=4, added=13))
    assert d.wanted == 4 and d.desired == 4  # ceil(13 / 4)
    clock.now += 11  # past the up cool-down; still nothing finished (400 added, 400 outstanding)
    d = a.observe(reading(4, outstanding=400, claimed=16, added=400))
    assert d.replica_tasks_per_s is None and d.desired == 5


def test_a_jump_is_taken_at_most_double_or_four_more_per_decision():
    a = scaler(Clock(), max_replicas=100)
    d = a.observe(reading(5, outstanding=400, claimed=20, added=400))
    assert d.wanted == 100 and d.desired == 10


def test_up_cool_down_holds_a_second_rise():
    clock = Clock()
    a = scaler(clock)
    assert a.observe(reading(1, outstanding=8, claimed=4, added=8)).desired == 2
    clock.now += 5
    held = a.observe(reading(2, outstanding=16, claimed=8, added=16))
    assert held.desired == 2 and "up cool-down" in held.reason
    clock.now += 6
    assert a.observe(reading(2, outstanding=16, claimed=8, added=16)).desired == 4


def test_scale_down_waits_for_its_window_and_cool_down_then_goes_to_the_windows_highest():
    clock = Clock()
    a = scaler(clock, max_replicas=8)
    assert a.observe(reading(1, outstanding=32, claimed=4, added=32)).desired == 5
    # The load is gone: every task finished, none arrive.
    for _ in range(6):
        clock.now += 10
        d = a.observe(reading(5, outstanding=0, claimed=0, added=32))
        assert d.wanted == 1
        assert d.desired == 5, f"fell {clock.now - 1000:.0f} s after the high: {d.reason}"
    clock.now += 10  # the high (at t=0) is now out of the 60 s window
    d = a.observe(reading(5, outstanding=0, claimed=0, added=32))
    assert d.desired == 1 and d.changed


def test_no_rise_while_the_learner_has_its_backlog():
    a = scaler(Clock())
    d = a.observe(reading(2, outstanding=40, claimed=8, added=40, backlog=100))
    assert d.wanted > 2 and d.desired == 2
    assert "wait for the learner" in d.reason


def test_bounds_hold_both_ways():
    clock = Clock()
    a = scaler(clock, min_replicas=2, max_replicas=3, scale_down_window_s=0, scale_down_cooldown_s=0)
    assert a.observe(reading(0, outstanding=0, claimed=0, added=0)).desired == 2
    clock.now += 1
    assert a.observe(reading(2, outstanding=1000, claimed=8, added=1000)).desired == 3


def test_min_above_max_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"min_replicas \(4\) is above max_replicas \(2\)"):
        AutoscaleConfig(min_replicas=4, max_replicas=2)


def test_what_a_replica_finishes_is_remembered_through_an_idle_spell():
    clock = Clock()
    a = scaler(clock)
    a.observe(reading(2, outstanding=8, claimed=8, added=100))
    clock.now += 10
    assert a.observe(reading(2, outstanding=8, claimed=8, added=116)).replica_tasks_per_s == pytest.approx(
        4 * 1.6 / 8
    )
    clock.now += 10  # the last 8 finish, none arrive: 8 done in 10 s with 4 claimed on average
    measured = a.observe(reading(2, outstanding=0, claimed=0, added=116)).replica_tasks_per_s
    assert measured == pytest.approx(4 * 0.8 / 4)
    for _ in range(5):  # nothing claimed: nothing to measure it on
        clock.now += 10
        idle = a.observe(reading(2, outstanding=0, claimed=0, added=116))
    assert idle.replica_tasks_per_s == pytest.approx(measured)


def test_a_rise_in_arrivals_is_acted_on_at_once_and_a_fall_waits_for_the_window():
    clock = Clock()
    a = scaler(clock, rate_window_s=60.0, scale_up_cooldown_s=0, max_replicas=64)
    added = 0
    for _ in range(10):  # 0.4 tasks/s for a long while, every task finished: a replica finishes 0.8/s
        clock.now += 5
        added += 2
        a.observe(reading(1, outstanding=1, claimed=1, added=added))
    clock.now += 5
    added += 20  # 4 tasks/s over the last interval
    d = a.observe(reading(1, outstanding=1, claimed=1, added=added))
    assert d.arrival_per_s < 1.0  # the 60 s average has hardly moved
    assert d.wanted >= math.ceil(4.0 / (d.replica_tasks_per_s * 0.5))  # but the last rate counts
    clock.now += 5  # back to 0.4/s: the scale-down window keeps the count the rise called for
    added += 2
    assert a.observe(reading(d.desired, outstanding=1, claimed=1, added=added)).desired == d.desired
