"""Groups that can no longer arrive are enqueued again, so a step never waits forever.

docs/reliability.md#lost-groups"""

from __future__ import annotations

import logging

from rlmesh.learner.run.collect import BatchCollector
from rlmesh.learner.run.feeder import PromptFeeder

log = logging.getLogger("rlmesh.learner")

MAX_TRIES = 2  # times a prompt is enqueued before it is replaced


class LostGroupRecovery:
    def __init__(self, feeder: PromptFeeder, collector: BatchCollector, *, quiet_checks: int = 2) -> None:
        self.feeder = feeder
        self.collector = collector
        self.quiet_checks = quiet_checks
        self._quiet = 0
        self.counts = {"requeued_lost": 0, "replaced_failed": 0}

    async def nothing_in_flight(self) -> bool:
        if await self.feeder.queue.length():  # first: see the module docstring
            return False
        return await self.collector.collector.queue.unread() == 0

    async def check(self, version: int) -> list[str]:
        """Call while a step waits for its batch. Enqueues the lost groups once nothing has been in
        flight for ``quiet_checks`` calls in a row; returns the uids of the groups enqueued."""
        if not await self.nothing_in_flight():
            self._quiet = 0
            return []
        self._quiet += 1
        if self._quiet < self.quiet_checks:
            return []
        self._quiet = 0
        complete = self.collector.complete_groups()
        lost = [gid for gid in self.feeder.outstanding if gid not in complete]
        if not lost:
            return []
        dead = {d.message.group_uid: d.reason for d in await self.feeder.queue.dead_letters() if d.message}
        enqueued = []
        for gid in lost:
            step, task, times = self.feeder.outstanding[gid]
            self.collector.drop_group(gid)
            why = dead.get(gid, "its task or samples are gone from Redis")
            if times >= MAX_TRIES:
                new = await self.feeder.replace(gid, version)
                self.counts["replaced_failed"] += 1
                log.error(
                    "prompt group %s of step %d failed %d times (last: %s); replaced by the next prompt, %s",
                    gid,
                    step,
                    times,
                    why,
                    new,
                )
            else:
                new = await self.feeder.requeue(gid, task, step, version)
                self.counts["requeued_lost"] += 1
                log.warning(
                    "prompt group %s of step %d is lost (%s); enqueued again as %s", gid, step, why, new
                )
            enqueued.append(new)
        return enqueued

    def take_counts(self) -> dict[str, int]:
        """The counts since the last call (a step's metrics)."""
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return counts
