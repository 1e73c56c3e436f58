"""Collecting one step's batch: whole prompt groups, fresh enough, each trajectory once, only the
groups ``keep_group`` keeps, failed rewards scored by ``rule``; a trajectory ``validate`` refuses is
dead-lettered and counts as a lost sample of its group. docs/reliability.md#collecting-a-step"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

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
            earlier = self.groups.pop(traj.group_uid, None)
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
                del self.groups[gid]
                self._discarded_ids += group.entry_ids
                self._discarded_uids += [t.uid for t in group.trajectories]
                self._filtered[gid] = len(group.trajectories)
                dropped.append(gid)
        return dropped

    async def collect(
        self,
        batch_groups: int,
        version: int,
        timeout_s: float,
        requeue: Callable[[Trajectory], Awaitable[None]],
        on_progress: Callable[[int, int], None] | None = None,
        refill: Callable[[list[str]], Awaitable[None]] | None = None,
        step: int = 0,
    ) -> StepBatch:
        """Waits until ``batch_groups`` complete groups are in (or ``timeout_s``: TimeoutError).
        ``refill`` gets the uids of the groups ``keep_group`` dropped, to draw prompts in their place.
        Raises ``RewardFailed`` (naming ``step``) once a batch's worth of samples came in and too
        many of their rewards failed, by ``rule``: before dynamic sampling draws prompt after prompt
        in place of groups that failed alike."""
        where = f"step {step}" if step else "this step"
        start = time.monotonic()
        while sum(g.complete(self.n) for g in self.groups.values()) < batch_groups:
            if time.monotonic() - start > timeout_s:
                have = sum(g.complete(self.n) for g in self.groups.values())
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
            if on_progress:
                on_progress(sum(g.complete(self.n) for g in self.groups.values()), batch_groups)
        if self.rule is not None:  # a group's earlier samples may have come in during the last step
            self.rule.check(self.rewards, where)
        taken = [gid for gid, g in self.groups.items() if g.complete(self.n)][:batch_groups]
        trajs, ids = [], list(self._discarded_ids)
        uids = list(self._discarded_uids)
        for gid in taken:
            group = self.groups.pop(gid)
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
        )

    def complete_groups(self) -> set[str]:
        return {gid for gid, g in self.groups.items() if g.complete(self.n)}

    def drop_group(self, group_uid: str) -> None:
        """Discards what arrived of an incomplete group (its other samples were lost); its entries
        are acked with the next commit."""
        group = self.groups.pop(group_uid, None)
        if group is not None:
            self._discarded_ids += group.entry_ids
            self._discarded_uids += [t.uid for t in group.trajectories]

    async def commit(self, batch: StepBatch, forget_uids: Sequence[str] = ()) -> None:
        """Marks the step's uids used and acks its entries, in one transaction (``forget_uids``
        leave the used set: see ``TrajectoryCollector.commit_ids``)."""
        await self.collector.commit_ids(batch.uids, batch.entry_ids, forget_uids)
        self._held.difference_update(batch.uids)
