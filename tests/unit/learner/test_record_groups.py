"""The learner's record of what each step trained on (``trained_groups.jsonl``), as the exactly-once
audit reads it: the prompt digests it writes are the ones the audit computes from the dataset."""

from __future__ import annotations

import pytest

from rlmesh.config import load_config
from rlmesh.learner.run.collect import StepBatch
from rlmesh.learner.run.feeder import group_uid
from rlmesh.learner.run.loop import TrainingLoop
from rlmesh.v1 import trajectory_pb2
from tests.support.jobs import N, Planned, audit_groups, make_files, overrides, planned_prompts
from tests.support.repo import CPU_DEMO

STEPS = 2


def batch_of(loop: TrainingLoop, step: int, planned: list[Planned], prompt_of: dict[int, int]) -> StepBatch:
    """What the collector hands the loop for ``step``: N samples a planned group, each with the
    prompt ids of dataset row ``prompt_of.get(index, index)``."""
    groups = [group_uid(1, step, p.index) for p in planned]
    trajectories = [
        trajectory_pb2.Trajectory(
            uid=f"{g}/{k}",
            group_uid=g,
            prompt_ids=loop.train_set[prompt_of.get(p.index, p.index)].prompt_ids,
            response_ids=[5],
        )
        for g, p in zip(groups, planned, strict=True)
        for k in range(N)
    ]
    uids = [t.uid for t in trajectories]
    return StepBatch(trajectories, entry_ids=[], uids=uids, counts={}, wait_s=0.0, groups=groups)


def test_the_recorded_prompt_digests_are_the_audits_of_each_groups_dataset_row(tmp_path):
    files = make_files(tmp_path)
    run_dir = tmp_path / "run"
    loop = TrainingLoop(load_config(str(CPU_DEMO), overrides(files, run_dir, STEPS)), lambda cfg, steps: None)
    try:
        plan = planned_prompts(files, run_dir, STEPS)
        assert loop.groups_path is not None
        for step in plan:
            loop._record_groups(step, batch_of(loop, step, plan[step], {}), incarnation=1)
        audit_groups(loop.groups_path, plan, N)

        # A group of step 2 whose samples were generated from another row's prompt: refused.
        loop.groups_path = tmp_path / "other" / "trained_groups.jsonl"
        loop._record_groups(1, batch_of(loop, 1, plan[1], {}), incarnation=1)
        first, other = plan[2][0].index, plan[1][0].index
        loop._record_groups(2, batch_of(loop, 2, plan[2], {first: other}), incarnation=1)
        with pytest.raises(
            AssertionError, match=rf"step 2 \(incarnation 1\): group i1:s2:d{first}:\w+ trained on"
        ):
            audit_groups(loop.groups_path, plan, N)
    finally:
        loop.sinks.close()
