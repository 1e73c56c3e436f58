"""The autoscaler's actuator for the replicas a job started on this machine (``rlmesh train``):
reads the run's fleet target and starts or stops its own replicas, one at a time, to match. A
replica is stopped by SIGTERM, which drains it: no task is lost. docs/control.md#autoscaling"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis as redis_sync

from rlmesh.queue.fleet_target import FleetTarget, decode_fleet_target, fleet_target_key
from rlmesh.queue.keys import RunKeys
from rlmesh.runtime.launcher import LaunchError

# A target this old is from a control plane that stopped deciding: the fleet is left as it is.
STALE_AFTER_S = 60.0
START_RETRY_S = 30.0  # after a replica failed to start: not a failing start every poll
POLL_S = 2.0  # the most an actuator waits between two reads of the target


def local_goal(target: FleetTarget, ours: set[str]) -> int:
    """How many of the replicas started here the target asks for: its count less the live
    replicas that were never ours (started elsewhere, attached to the run), never below 0. One we
    stopped may still be listed (the target is a poll old): it is ours, not another's."""
    others = [r for r in target.live if r not in ours]
    return max(0, target.desired - len(others))


class LocalFleet:
    """Reconciles ``stack``'s replicas with the run's target every ``poll_s`` in a thread that lives
    as long as the process (a child started by a thread gets its parent-death signal when that
    thread ends); ``close`` makes it stop acting. ``limit``: the most replicas it may run (a GPU
    plan's count), None for no limit."""

    def __init__(
        self,
        stack: Any,
        keys: RunKeys,
        say: Callable[[str], None],
        *,
        poll_s: float = 2.0,
        stale_after_s: float = STALE_AFTER_S,
        limit: int | None = None,
    ) -> None:
        self.stack, self.keys, self.say = stack, keys, say
        self.poll_s, self.stale_after_s, self.limit = poll_s, stale_after_s, limit
        self.redis = redis_sync.Redis.from_url(stack.redis_url, socket_timeout=5)
        self.closed = threading.Event()
        self.acting = False  # a replica is being started or stopped
        self.retry_at = 0.0  # no start before this (monotonic): the last one failed
        self.ours = set(self.local())  # every replica id this actuator started or was given
        self.added: list[str] = []  # replicas started to follow the target
        self.stopped: list[tuple[str, int | None]] = []  # replicas stopped, with their exit codes
        self._said = ""
        threading.Thread(target=self._run, daemon=True, name="local-fleet").start()

    def close(self) -> None:
        self.closed.set()

    def local(self) -> list[str]:
        """The replicas started here, oldest first (``rollout-<i>`` by ``i``)."""
        names = [r.name for r in self.stack.rollouts]
        return sorted(names, key=lambda n: (len(n), n))

    def _say_once(self, line: str) -> None:
        if line != self._said:
            self.say(line)
            self._said = line

    def read_target(self) -> FleetTarget | None:
        try:
            raw = self.redis.get(fleet_target_key(self.keys))
        except redis_sync.RedisError as e:
            self._say_once(f"autoscaler: cannot read the fleet target ({e}); the replicas stay as they are")
            return None
        target = decode_fleet_target(self.keys, raw)
        if target is None:
            return None
        age_s = time.time() - target.unix_ms / 1000
        if age_s > self.stale_after_s:
            self._say_once(
                f"autoscaler: its last target is {age_s:.0f} s old (the control plane stopped deciding?); "
                "the replicas stay as they are"
            )
            return None
        return target

    def step(self) -> bool:
        """One reconciliation: at most one replica started or stopped. True when it changed one."""
        target = self.read_target()
        if target is None or self.closed.is_set():
            return False
        local = self.local()
        goal = local_goal(target, self.ours | set(local))
        if self.limit is not None and goal > self.limit:
            self._say_once(
                f"autoscaler: {goal} replicas wanted here, {self.limit} fit this machine's GPU plan"
            )
            goal = self.limit
        if goal > len(local):
            if time.monotonic() < self.retry_at:
                return False
            self.say(f"autoscaler: {len(local)} -> {goal} replicas here ({target.reason}); starting one")
            try:
                instance = self.stack.add_replica()
            except LaunchError as e:
                self.retry_at = time.monotonic() + START_RETRY_S
                self.say(
                    f"autoscaler: a new replica did not start ({e.headline}); trying again in {START_RETRY_S:.0f} s"
                )
                return False
            self.added.append(instance.name)
            self.ours.add(instance.name)
            self.say(
                f"{instance.name:<12} {instance.grpc_address} (pid {instance.process.pid}, added by the autoscaler)"
            )
        elif goal < len(local):
            # The newest running one goes first; a dead one is being restarted by the supervisor.
            name = next((n for n in reversed(local) if self.stack.replica_alive(n)), "")
            if not name:
                return False
            self.say(
                f"autoscaler: {len(local)} -> {goal} replicas here ({target.reason}); stopping {name} "
                "(it finishes its tasks and gives back the rest)"
            )
            code = self.stack.remove_replica(name)
            self.stopped.append((name, code))
            self.say(f"{name} stopped (exit code {code})")
        else:
            return False
        self._said = ""
        return True

    def _run(self) -> None:
        while True:
            if self.closed.wait(self.poll_s):
                threading.Event().wait()  # lives on, idle: see the class docstring
            try:
                self.acting = True
                while self.step():
                    pass
            except Exception as e:  # a bug here must not end the job: it is said, and tried again
                self._say_once(f"autoscaler: reconciling the replicas failed: {type(e).__name__}: {e}")
            finally:
                self.acting = False


def follow_target(
    stack: Any,
    cfg: Any,
    run_id: str,
    say: Callable[[str], None],
    *,
    what: str = "replicas",
    limit: int | None = None,
) -> LocalFleet:
    """The actuator of a job whose config has rlmesh.control.autoscale on, over ``stack`` (a
    ``Stack``, or anything with its replica methods: ``rlmesh ray up``'s actors); says its bounds."""
    scale = cfg.rlmesh.control.autoscale
    say(f"autoscaler: between {scale.min_replicas} and {scale.max_replicas} {what}, from the load")
    keys = RunKeys.signed(run_id, cfg.rlmesh.token())
    return LocalFleet(stack, keys, say, poll_s=min(scale.poll_s, POLL_S), limit=limit)
