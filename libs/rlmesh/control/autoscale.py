"""The autoscaler (``rlmesh.control.autoscale``): the rollout replica count from the prompt backlog,
the rates tasks arrive and finish at and the learner's backlog, bounded, with cool-downs; a pure
decision (``Autoscaler``) and its reading of the run's Redis (``read_fleet``). docs/control.md#autoscaling"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from rlmesh.config.rlmesh_section import AutoscaleConfig
from rlmesh.control.fleet import queue_depths
from rlmesh.queue import ReplicaRegistry, RunKeys

DRAINING = "draining"
# Tasks finished within the rate window before a slot's rate is read from them: fewer say more of
# when the tasks started than of how long they take.
MIN_FINISHED = 4


@dataclass(frozen=True)
class Interval:
    """What happened between two readings."""

    end_s: float
    seconds: float
    added: int
    finished: int
    claimed_s: float  # task-seconds claimed (the claimed count's mean times the seconds)


@dataclass(frozen=True)
class FleetReading:
    """The fleet and its queues at one instant."""

    live: list[str]  # replica ids registered and not draining
    outstanding: int  # prompt tasks not yet acknowledged: waiting or claimed (the stream's length)
    claimed: int  # of those, handed to a replica and not finished (the rollout group's pending)
    added_total: int  # prompt tasks ever added to the stream (its entries-added counter)
    capacity: int  # task slots of one replica (the registrations' tasks_in_flight)
    learner_backlog: int  # trajectories no learner rank has read yet

    @property
    def unclaimed(self) -> int:
        return max(0, self.outstanding - self.claimed)


@dataclass(frozen=True)
class ScaleDecision:
    desired: int  # what the actuators should run now
    wanted: int  # what the load calls for now, within the bounds, before cool-downs and the window
    reason: str
    arrival_per_s: float  # tasks added to the prompt stream per second (averaged)
    done_per_s: float  # tasks finished per second (averaged)
    replica_tasks_per_s: float | None  # what one replica finishes per second with every slot busy
    before: int  # the desired count before this decision (the first: the live count, bounded)

    @property
    def changed(self) -> bool:
        return self.desired != self.before


class Autoscaler:
    """Decides the desired replica count from one ``FleetReading`` after another.

    Over the readings of the last ``rate_window_s`` it sums, interval by interval, the tasks
    added, the tasks finished (added minus the growth of the outstanding set) and the task-seconds
    claimed: λ, the tasks arriving a second (the last interval's rate when it is higher, so that a
    rise is acted on at once); D, the tasks finishing a second. By Little's law a task slot
    finishes (tasks finished) / (task-seconds claimed) a second, so one replica with ``capacity``
    slots finishes μ = capacity times that, measured once ``MIN_FINISHED`` tasks finished in the
    window and kept through idle spells. The load calls for

        n = ⌈ λ / (μ · target_utilization) + unclaimed / (μ · target_backlog_s) ⌉,

    at least the replicas the claimed tasks occupy (⌈C / capacity⌉): the arrivals served with room
    to spare, a backlog cleared within ``target_backlog_s``. Before any task finished (μ unknown)
    it calls for a slot per outstanding task; with nothing outstanding and nothing arriving, for
    ``min_replicas``. A count above the current one is held while the learner's backlog is at
    ``learner_backlog_limit`` (the learner sets the pace), taken at most to twice the current
    count (or four more) per decision, and not sooner than ``scale_up_cooldown_s`` after the last
    change. A count below it is the highest called for over ``scale_down_window_s``, not sooner
    than ``scale_down_cooldown_s`` after the last change."""

    def __init__(
        self,
        cfg: AutoscaleConfig,
        learner_backlog_limit: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.learner_backlog_limit = learner_backlog_limit
        self.clock = clock
        self.desired: int | None = None
        self.last_change_s = float("-inf")
        self.arrival_per_s = 0.0  # over the window
        self.last_arrival_per_s = 0.0  # over the last interval alone
        self.done_per_s = 0.0
        self.slot_tasks_per_s: float | None = None  # tasks one slot finishes a second, once measured
        self.intervals: deque[Interval] = deque()
        self.wanted_history: deque[tuple[float, int]] = deque()
        self._last: tuple[float, FleetReading] | None = None

    def replica_tasks_per_s(self, capacity: int) -> float | None:
        """μ: tasks one replica finishes a second with every slot busy; None until measured. Kept
        through idle spells (nothing claimed says nothing of it)."""
        return None if self.slot_tasks_per_s is None else capacity * self.slot_tasks_per_s

    def _rates(self, now: float, reading: FleetReading) -> None:
        if self._last is None:
            self._last = (now, reading)
            return
        then, before = self._last
        dt = now - then
        if dt <= 0:
            return
        added = reading.added_total - before.added_total
        if added < 0:  # the stream was created anew (a Redis without persistence came back)
            added = reading.added_total
        done = max(0, added - (reading.outstanding - before.outstanding))
        self.intervals.append(Interval(now, dt, added, done, dt * (reading.claimed + before.claimed) / 2))
        while len(self.intervals) > 1 and now - self.intervals[0].end_s >= self.cfg.rate_window_s:
            self.intervals.popleft()
        seconds = sum(i.seconds for i in self.intervals)
        finished = sum(i.finished for i in self.intervals)
        claimed_s = sum(i.claimed_s for i in self.intervals)
        self.arrival_per_s = sum(i.added for i in self.intervals) / seconds
        self.last_arrival_per_s = added / dt
        self.done_per_s = finished / seconds
        if finished >= MIN_FINISHED and claimed_s > 0:
            self.slot_tasks_per_s = finished / claimed_s
        self._last = (now, reading)

    def load_calls_for(self, reading: FleetReading) -> tuple[int, str]:
        """The replicas the load calls for, unbounded, and why."""
        cap = max(1, reading.capacity)
        # A rise in arrivals is acted on at once, a fall only as the average follows it (and the
        # scale-down window on top): up fast, down slow.
        arrival = max(self.arrival_per_s, self.last_arrival_per_s)
        mu = self.replica_tasks_per_s(cap)
        if reading.outstanding == 0 and arrival < 1e-3:
            return self.cfg.min_replicas, "no tasks outstanding or arriving"
        if mu is None:
            n = math.ceil(reading.outstanding / cap)
            return (
                n,
                f"{reading.outstanding} tasks outstanding, none finished yet: a slot each ({cap} a replica)",
            )
        serve = arrival / (mu * self.cfg.target_utilization)
        clear = reading.unclaimed / (mu * self.cfg.target_backlog_s)
        n = max(math.ceil(serve + clear - 1e-9), math.ceil(reading.claimed / cap))
        return n, (
            f"{arrival:.2f} tasks/s arriving, {reading.unclaimed} unclaimed, {reading.claimed} claimed; "
            f"a replica finishes {mu:.3g}/s"
        )

    def observe(self, reading: FleetReading) -> ScaleDecision:
        now = self.clock()
        self._rates(now, reading)
        cfg = self.cfg
        raw, why = self.load_calls_for(reading)
        wanted = min(max(raw, cfg.min_replicas), cfg.max_replicas)
        if wanted != raw:
            why += f"; {raw} called for, bounded to [{cfg.min_replicas}, {cfg.max_replicas}]"
        current = (
            self.desired
            if self.desired is not None
            else min(max(len(reading.live), cfg.min_replicas), cfg.max_replicas)
        )
        self.wanted_history.append((now, wanted))
        while self.wanted_history and now - self.wanted_history[0][0] > cfg.scale_down_window_s:
            self.wanted_history.popleft()
        since = now - self.last_change_s
        desired = current
        if wanted > current:
            step_cap = max(2 * current, current + 4)
            if reading.learner_backlog >= self.learner_backlog_limit > 0:
                why += (
                    f"; held at {current}: {reading.learner_backlog} trajectories wait for the learner "
                    f"(limit {self.learner_backlog_limit})"
                )
            elif since < cfg.scale_up_cooldown_s:
                why += f"; held at {current}: {since:.0f} s since the last change (up cool-down {cfg.scale_up_cooldown_s:g} s)"
            else:
                desired = min(wanted, step_cap)
                if desired < wanted:
                    why += f"; {wanted} wanted, {desired} this step (at most double, or 4 more)"
        elif wanted < current:
            window_high = max(w for _, w in self.wanted_history)
            if window_high >= current:
                why += f"; held at {current}: {window_high} called for within {cfg.scale_down_window_s:g} s"
            elif since < cfg.scale_down_cooldown_s:
                why += f"; held at {current}: {since:.0f} s since the last change (down cool-down {cfg.scale_down_cooldown_s:g} s)"
            else:
                desired = window_high
        if desired != current:
            self.last_change_s = now
        self.desired = desired
        return ScaleDecision(
            desired=desired,
            wanted=wanted,
            reason=why,
            arrival_per_s=self.arrival_per_s,
            done_per_s=self.done_per_s,
            replica_tasks_per_s=self.replica_tasks_per_s(max(1, reading.capacity)),
            before=current,
        )


async def _added_total(redis: aioredis.Redis, stream: str) -> int:
    """Entries ever added to a stream; 0 before it exists."""
    try:
        info = await redis.xinfo_stream(stream)
    except ResponseError:
        return 0
    return int(info.get("entries-added", info.get("entries_added", 0)) or 0)


async def read_fleet(
    redis: aioredis.Redis, keys: RunKeys, registry: ReplicaRegistry, default_capacity: int
) -> FleetReading:
    """One ``FleetReading`` of the run: its registry and two streams, a handful of commands
    whatever the fleet's size (no call to any replica)."""
    regs = [r for r in await registry.live() if r.state != DRAINING]
    added = await _added_total(redis, keys.prompts)
    depths = await queue_depths(redis, keys)
    capacities = [r.capacity for r in regs if r.capacity > 0]
    return FleetReading(
        live=sorted(r.replica_id for r in regs),
        outstanding=depths["prompts"]["length"],
        claimed=depths["prompts"]["pending"],
        added_total=added,
        capacity=int(statistics.median(capacities)) if capacities else default_capacity,
        learner_backlog=max(0, depths["trajectories"]["unread"]),
    )
