"""Prompt tasks for upcoming steps: ``1 + max_staleness`` batches ahead, and ``extra`` groups more.

docs/reliability.md#prompt-tasks-and-incarnations"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Sequence
from typing import Any

from rlmesh.data import PromptCursor, PromptItem
from rlmesh.queue.streams import StreamQueue
from rlmesh.v1 import common_pb2, trajectory_pb2


def group_uid(incarnation: int, step: int, item_index: int) -> str:
    return f"i{incarnation}:s{step}:d{item_index}:{uuid.uuid4().hex[:8]}"


def _uid_field(group: str, position: int, letter: str) -> int:
    """The number after ``letter`` in field ``position`` of a group uid (``group_uid``'s
    ``i<incarnation>:s<step>:d<index>:<random>``), or -1 where the uid has no such field."""
    parts = group.split(":")
    field = parts[position] if len(parts) > position else ""
    return int(field[1:]) if field[:1] == letter and field[1:].isdigit() else -1


def index_of(group: str) -> int:
    """The dataset index encoded in a group uid, or -1 (a prompt rlmesh did not draw from the data)."""
    return _uid_field(group, 2, "d")


def step_of(group: str) -> int:
    """The step whose prompts a group uid was enqueued with, or -1 for a uid rlmesh did not make."""
    return _uid_field(group, 1, "s")


def incarnation_of(group: str) -> int:
    """The incarnation encoded in a group uid, or -1 for a uid rlmesh did not make."""
    return _uid_field(group, 0, "i")


class PromptFeeder:
    def __init__(
        self,
        queue: StreamQueue[trajectory_pb2.PromptTask],
        dataset: Sequence[PromptItem],
        cursor: PromptCursor,
        *,
        batch_size: int,
        n: int,
        incarnation: int,
        sampling: common_pb2.SamplingParams | None = None,
        greedy_baseline: bool = False,
        extra: int = 0,
    ) -> None:
        self.queue = queue
        self.dataset = dataset
        self.cursor = cursor
        self.batch_size = batch_size
        self.n = n
        self.incarnation = incarnation
        self.sampling = sampling or common_pb2.SamplingParams()
        self.greedy_baseline = greedy_baseline  # ReMax: each task also asks for a greedy baseline
        # Groups kept in flight beyond the steps' batches (rlmesh.over_provision, APRIL): a step
        # takes the first batch_size complete ones and the rest serve the next.
        self.extra = extra
        self.enqueued: dict[int, list[str]] = {}  # step -> group uids
        self.epoch_of: dict[int, int] = {}  # step -> the data epoch its batch starts in
        # Dataset indices a checkpoint had in flight (load_state_dict): enqueued before any draw.
        self.carried: list[int] = []
        # Every group enqueued and not yet trained on: uid -> (step, task, times enqueued), so a
        # group whose task or samples were lost can be enqueued again.
        self.outstanding: dict[str, tuple[int, trajectory_pb2.PromptTask, int]] = {}

    def make_task(self, item: PromptItem, step: int, version: int) -> trajectory_pb2.PromptTask:
        import json

        gid = group_uid(self.incarnation, step, item.index)
        return trajectory_pb2.PromptTask(
            uid=gid,
            group_uid=gid,
            sample_offset=0,
            n=self.n,
            prompt_ids=item.prompt_ids,
            prompt_text=item.prompt_text,
            ground_truth=str(item.ground_truth),
            data_source=item.data_source,
            extra_info_json=json.dumps(item.extra_info, default=str),
            policy_version=version,
            sampling_params=self.sampling,
            step=step,
            enqueued_unix_ms=int(time.time() * 1000),
            greedy_baseline=self.greedy_baseline,
        )

    async def ensure(self, step: int, version: int, max_staleness: int) -> list[int]:
        """Enqueues the prompts of steps ``step .. step + max_staleness`` not enqueued yet; returns
        those steps. Step ``s`` tops the groups in flight up to ``(s - step + 1) * batch_size +
        extra``: a whole batch in a steady run (the step before took one), more at the start, fewer
        after a resume that enqueues what its checkpoint had in flight first."""
        added = []
        for s in range(step, step + max_staleness + 1):
            if s in self.enqueued:
                continue
            before = copy.deepcopy(self.cursor.state_dict())
            carried = self.carried
            want = (s - step + 1) * self.batch_size + self.extra - len(self.outstanding) - len(carried)
            self.epoch_of[s] = self.cursor.epoch_of_next(self.batch_size)
            drawn = self.cursor.next_indices(want) if want > 0 else []
            tasks = [self.make_task(self.dataset[i], s, version) for i in carried + drawn]
            try:
                if tasks:
                    await self.queue.put(tasks)
            except BaseException:
                # Not enqueued: the next try must draw the same prompts for step s.
                self.cursor.load_state_dict(before)
                self.epoch_of.pop(s)
                raise
            self.carried = []
            self.enqueued[s] = [t.group_uid for t in tasks]
            self.outstanding.update({t.group_uid: (s, t, 1) for t in tasks})
            added.append(s)
        return added

    async def requeue(self, replaces: str, task: trajectory_pb2.PromptTask, step: int, version: int) -> str:
        """Enqueues a prompt again under a new group uid, in place of group ``replaces`` (its samples
        came back too stale, or were lost)."""
        _, _, times = self.outstanding.pop(replaces)
        gid = group_uid(self.incarnation, step, index_of(replaces))  # the same prompt
        fresh = trajectory_pb2.PromptTask()
        fresh.CopyFrom(task)
        fresh.uid = fresh.group_uid = gid
        fresh.sample_offset = 0
        fresh.step, fresh.policy_version = step, version
        fresh.enqueued_unix_ms = int(time.time() * 1000)
        await self.queue.put([fresh])
        self.outstanding[gid] = (step, fresh, times + 1)
        return gid

    async def replace(self, replaces: str, version: int) -> str:
        """Enqueues the next prompt of the data in place of group ``replaces`` (a prompt that failed
        every time it was tried, or a group dynamic sampling dropped). Nothing changes when the put
        fails, so it can be tried again."""
        step, _, _ = self.outstanding[replaces]
        before = copy.deepcopy(self.cursor.state_dict())
        item = self.dataset[self.cursor.next_indices(1)[0]]
        task = self.make_task(item, step, version)
        try:
            await self.queue.put([task])
        except BaseException:
            self.cursor.load_state_dict(before)  # the next try draws the same prompt
            raise
        del self.outstanding[replaces]
        self.outstanding[task.group_uid] = (step, task, 1)
        return task.group_uid

    def taken(self, group_uids: Sequence[str]) -> None:
        """These groups went into a step's batch: no longer outstanding."""
        for gid in group_uids:
            self.outstanding.pop(gid, None)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint after a step keeps: the data cursor past every prompt drawn, and the
        dataset indices of the groups in flight (enqueued, not trained), in the order they were
        enqueued. A resume enqueues those first, so no prompt is skipped or trained twice, however
        far ahead the feeder was (``max_staleness``, ``extra``)."""
        return {
            "data_cursor": copy.deepcopy(self.cursor.state_dict()),
            "prompts_in_flight": [index_of(gid) for gid in self.outstanding],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state_dict``'s cursor and prompts in flight. A checkpoint of an older learner
        holds the cursor only (``data_cursor``: as the step after it draws)."""
        in_flight = [int(i) for i in state.get("prompts_in_flight", [])]
        if bad := [i for i in in_flight if not 0 <= i < len(self.dataset)]:
            raise ValueError(
                f"the checkpoint's prompts in flight name rows {bad[:5]} outside the training set "
                f"({len(self.dataset)} rows): it was written for other data"
            )
        self.cursor.load_state_dict(state["data_cursor"])
        self.carried = in_flight

    def forget_before(self, step: int) -> None:
        for s in [s for s in self.enqueued if s < step]:
            self.enqueued.pop(s, None)
            self.epoch_of.pop(s, None)
