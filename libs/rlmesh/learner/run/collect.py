"""Collecting one step's batch: the first whole prompt groups to complete, fresh enough, each
trajectory once, their rows written as they complete; a trajectory ``validate`` refuses is
dead-lettered and counts as a lost sample of its group. docs/reliability.md#collecting-a-step"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from rlmesh.learner.ppo.batch import BatchBuilder, PPOBatch
from rlmesh.learner.run.feeder import incarnation_of
from rlmesh.queue.trajectories import CollectedBatch, TrajectoryCollector
from rlmesh.reward.failures import FailureTally, RewardErrorRule, is_reward_failure
from rlmesh.v1 import trajectory_pb2

log = logging.getLogger("rlmesh.learner")

Trajectory = trajectory_pb2.Trajectory


@dataclass
class Group:
    trajectories: list[Trajectory] = field(default_factory=list)
    entry_ids: list[bytes] = field(default_factory=list)
    dropped: int = 0
    checked: bool = False  # seen complete by keep_group (and kept)

    def complete(self, n: int) -> bool:
        return len(self.trajectories) + self.dropped >= n


@dataclass
class StepBatch:
    trajectories: list[Trajectory]
    entry_ids: list[bytes]  # every entry this step consumed, discarded ones included
    uids: list[str]
    counts: dict[str, int]
    wait_s: float
    groups: list[str] = field(default_factory=list)  # the group uids taken
    filtered: dict[str, int] = field(default_factory=dict)  # groups keep_group dropped -> their samples
    rewards: FailureTally = field(default_factory=FailureTally)  # samples that came in; rewards failed
    batch: PPOBatch | None = None  # the trajectories' rows, when collect was given a builder


@dataclass
class GroupRows:
    """A step's batch being written as its groups complete: the builder and the groups placed."""

    builder: BatchBuilder
    groups: list[str] = field(default_factory=list)


class BatchCollector:
    def __init__(
        self,
        collector: TrajectoryCollector,
        *,
        n: int,
        incarnation: int,
        max_staleness: int,
        validate: Callable[[Trajectory], str | None],
        wanted: Callable[[str], bool] | None = None,
        keep_group: Callable[[Sequence[Trajectory]], bool] | None = None,
        rule: RewardErrorRule | None = None,
    ) -> None:
        self.collector = collector
        self.wanted = wanted  # group uid -> still waited for; None: every group is
        self.keep_group = keep_group  # a complete group's samples -> trained on; None: every group is
        self._filtered: dict[str, int] = {}
        self.n = n
        self.incarnation = incarnation
        self.max_staleness = max_staleness
        self.validate = validate
        # None: a failed reward's sample is refused by validate like any sample with an error.
        self.rule = rule
        self.rewards = FailureTally()
        self.groups: OrderedDict[str, Group] = OrderedDict()
        # Complete groups (kept by keep_group) in the order they completed: a step takes the first.
        self._ready: dict[str, None] = {}
        self._rows: GroupRows | None = None  # this step's batch so far (collect's new_batch)
        self._discarded_ids: list[bytes] = []
        self._discarded_uids: list[str] = []
        self.counts = dict.fromkeys(
            ("stale", "rolled_back_policy", "old_incarnation", "abandoned_group", "invalid", "duplicates"), 0
        )
        # Policy versions a learner before this one pushed past the checkpoint this one resumed
        # from (TrainingLoop: versions are never reused): weights the run no longer has.
        self.refused_versions: list[tuple[int, int]] = []
        self._held: set[str] = set()  # uids claimed and not yet committed: a second copy is redundant

    def refused_policy(self, policy_version: int, version: int) -> bool:
        """A sample of weights the learner never had: newer than its own, or rolled back."""
        return policy_version > version or any(lo <= policy_version <= hi for lo, hi in self.refused_versions)

    async def _add(
        self, traj: Trajectory, entry_id: bytes, version: int, stale_groups: dict[str, Trajectory]
    ) -> None:
        if incarnation_of(traj.group_uid) != self.incarnation:
            self.counts["old_incarnation"] += 1
            self._discard(traj, entry_id)
            return
        if self.wanted is not None and not self.wanted(traj.group_uid):
            self.counts["abandoned_group"] += 1
            self._discard(traj, entry_id)
            return
        # Any token of weights the learner never had refuses the sample (an in-place update
        # gives a response tokens of several versions).
        refused = any(
            self.refused_policy(v, version) for v in {traj.policy_version, *traj.token_policy_versions}
        )
        if traj.policy_version < version - self.max_staleness or refused:
            self.counts["rolled_back_policy" if refused else "stale"] += 1
            self._discard(traj, entry_id)
            stale_groups.setdefault(traj.group_uid, traj)
            earlier = self._pop_group(traj.group_uid)
            if earlier is not None:  # samples of the group that arrived before count as discarded too
                self._discarded_ids += earlier.entry_ids
                self._discarded_uids += [t.uid for t in earlier.trajectories]
            return
        if traj.group_uid in stale_groups:
            self._discard(traj, entry_id)
            return
        group = self.groups.setdefault(traj.group_uid, Group())
        failed = is_reward_failure(traj.error)
        self.rewards.add((traj.error.message or traj.error.source) if failed else None)
        received = traj
        if self.rule is not None:
            traj = self.rule.apply(traj)
        reason = self.validate(traj)
        if reason is not None:
            self.counts["invalid"] += 1
            group.dropped += 1
            # Its uid is marked used with the step, so another copy of it is not trained on either.
            self._discarded_uids.append(traj.uid)
            why = f"invalid: {reason} (trajectory {traj.uid} of replica {traj.replica_id!r})"
            await self.collector.queue.dead_letter_message(entry_id, received, why, 1)
            return
        group.entry_ids.append(entry_id)
        group.trajectories.append(traj)

    def _discard(self, traj: Trajectory, entry_id: bytes) -> None:
        self._discarded_ids.append(entry_id)
        self._discarded_uids.append(traj.uid)

    def _filter_groups(self) -> list[str]:
        """Drops each newly complete group ``keep_group`` rejects; its entries are acked and its uids
        marked used with the next commit, as any discarded sample's. Returns the uids dropped."""
        if self.keep_group is None:
            return []
        dropped = []
        for gid, group in list(self.groups.items()):
            if group.checked or not group.complete(self.n):
                continue
            group.checked = True
            if not self.keep_group(group.trajectories):
                self._pop_group(gid)
                self._discarded_ids += group.entry_ids
                self._discarded_uids += [t.uid for t in group.trajectories]
                self._filtered[gid] = len(group.trajectories)
                dropped.append(gid)
        return dropped

    def _pop_group(self, gid: str) -> Group | None:
        """Forgets group ``gid``; a batch it was written into is begun again without it."""
        self._ready.pop(gid, None)
        if self._rows is not None and gid in self._rows.groups:
            self._rows = None
        return self.groups.pop(gid, None)

    def _mark_ready(self) -> None:
        for gid, group in self.groups.items():
            if (
                gid not in self._ready
                and group.complete(self.n)
                and (self.keep_group is None or group.checked)
            ):
                self._ready[gid] = None

    async def _place(self, batch_groups: int, new_batch: Callable[[], BatchBuilder] | None) -> None:
        """Writes the rows of the ready groups this step takes into its batch (off the event loop:
        numpy's copies let it run)."""
        if new_batch is None:
            return
        if self._rows is None:
            self._rows = GroupRows(new_batch())
        rows = self._rows
        more = [gid for gid in list(self._ready)[:batch_groups] if gid not in rows.groups]
        if more:
            await asyncio.to_thread(
                rows.builder.add, [t for gid in more for t in self.groups[gid].trajectories]
            )
            rows.groups += more

    async def collect(
        self,
        batch_groups: int,
        version: int,
        timeout_s: float,
        requeue: Callable[[Trajectory], Awaitable[None]],
        on_progress: Callable[[int, int], None] | None = None,
        refill: Callable[[list[str]], Awaitable[None]] | None = None,
        step: int = 0,
        new_batch: Callable[[], BatchBuilder] | None = None,
    ) -> StepBatch:
        """Waits until ``batch_groups`` complete groups are in (or ``timeout_s``: TimeoutError).
        ``refill`` gets the uids of the groups ``keep_group`` dropped, to draw prompts in their place.
        Raises ``RewardFailed`` (naming ``step``) once a batch's worth of samples came in and too
        many of their rewards failed, by ``rule``: before dynamic sampling draws prompt after prompt
        in place of groups that failed alike. With ``new_batch`` (an empty builder of the step's
        batch), the groups taken are written into it as they complete, kept across calls that time
        out, and the ``StepBatch`` carries the finished batch."""
        where = f"step {step}" if step else "this step"
        start = time.monotonic()
        self._mark_ready()
        await self._place(batch_groups, new_batch)
        while len(self._ready) < batch_groups:
            if time.monotonic() - start > timeout_s:
                have = len(self._ready)
                raise TimeoutError(
                    f"only {have} of {batch_groups} prompt groups arrived within {timeout_s:.0f} s; "
                    "are rollout replicas running? (rlmesh ps / the replica registry)"
                )
            claimed = CollectedBatch()
            await self.collector.collect(claimed, want=batch_groups * self.n, block_ms=200)
            self.counts["duplicates"] += claimed.duplicates
            stale_groups: dict[str, Trajectory] = {}
            redundant = []
            for traj, eid in zip(claimed.trajectories, claimed.entry_ids, strict=True):
                if traj.uid in self._held:
                    redundant.append(eid)
                    continue
                self._held.add(traj.uid)
                await self._add(traj, eid, version, stale_groups)
            if redundant:
                self.counts["duplicates"] += len(redundant)
                await self.collector.queue.ack(redundant)
            if self.rule is not None and self.rewards.samples >= batch_groups * self.n:
                self.rule.check(self.rewards, where)
            for traj in stale_groups.values():
                await requeue(traj)
            dropped = self._filter_groups()
            if dropped and refill is not None:
                await refill(dropped)
            self._mark_ready()
            await self._place(batch_groups, new_batch)
            if on_progress:
                on_progress(len(self._ready), batch_groups)
        if self.rule is not None:  # a group's earlier samples may have come in during the last step
            self.rule.check(self.rewards, where)
        taken = list(self._ready)[:batch_groups]
        batch = None
        if new_batch is not None:  # the loop placed the groups it saw ready
            rows = self._rows
            taken_rows = sum(len(self.groups[gid].trajectories) for gid in taken)
            if rows is None or rows.groups != taken or rows.builder.n != taken_rows:
                # A sample joined a complete group after its rows were written (a copy of one under
                # another uid): the rows must be the trajectories committed, so they are written again.
                log.warning("step %s: the batch's rows are written again at the end", step)
                rows = self._rows = None
                await self._place(batch_groups, new_batch)
                rows = self._rows
            assert rows is not None
            batch = await asyncio.to_thread(rows.builder.finish)
            self._rows = None
        trajs, ids = [], list(self._discarded_ids)
        uids = list(self._discarded_uids)
        for gid in taken:
            group = self._pop_group(gid)
            assert group is not None
            trajs += group.trajectories
            ids += group.entry_ids
            uids += [t.uid for t in group.trajectories]
        self._discarded_ids, self._discarded_uids = [], []
        filtered, self._filtered = self._filtered, {}
        counts = dict(self.counts)
        self.counts = dict.fromkeys(self.counts, 0)
        rewards, self.rewards = self.rewards, FailureTally()
        return StepBatch(
            trajectories=trajs,
            entry_ids=ids,
            uids=uids,
            counts=counts,
            wait_s=time.monotonic() - start,
            groups=taken,
            filtered=filtered,
            rewards=rewards,
            batch=batch,
        )

    def complete_groups(self) -> set[str]:
        return {gid for gid, g in self.groups.items() if g.complete(self.n)}

    def drop_group(self, group_uid: str) -> None:
        """Discards what arrived of an incomplete group (its other samples were lost); its entries
        are acked with the next commit."""
        group = self._pop_group(group_uid)
        if group is not None:
            self._discarded_ids += group.entry_ids
            self._discarded_uids += [t.uid for t in group.trajectories]

    async def commit(self, batch: StepBatch, forget_uids: Sequence[str] = ()) -> None:
        """Marks the step's uids used and acks its entries, in one transaction (``forget_uids``
        leave the used set: see ``TrajectoryCollector.commit_ids``)."""
        await self.collector.commit_ids(batch.uids, batch.entry_ids, forget_uids)
        self._held.difference_update(batch.uids)
