"""DAPO's dynamic sampling (``algorithm.filter_groups``): a complete prompt group whose metric is the
same for every sample gives a group estimator no signal; it is dropped and a new prompt drawn in its
place, within ``max_num_gen_batches`` batches of prompts per step. docs/algorithms.md#dapo"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from rlmesh.config.sections import SEQUENCE_REWARD_METRICS
from rlmesh.learner.run.feeder import PromptFeeder
from rlmesh.queue import retry_redis_with_deadline
from rlmesh.v1.trajectory_pb2 import Trajectory


class DynamicSamplingError(ValueError):
    """A step cannot be filled (too many groups dropped), or a trajectory lacks the metric."""


def keeps_group(values: Sequence[float]) -> bool:
    """verl's rule: a group is kept when its metric varies (``np.std > 0``) or it holds one sample."""
    if not values:  # every sample refused as invalid: nothing to train on
        return False
    return len(values) == 1 or float(np.std(np.asarray(values, dtype=np.float64))) > 0


def kept_groups(values_by_group: Mapping[str, Sequence[float]]) -> list[str]:
    """The groups ``keeps_group`` keeps, in the mapping's order."""
    return [gid for gid, values in values_by_group.items() if keeps_group(values)]


def group_metric(traj: Trajectory, metric: str) -> float:
    """A sample's ``filter_groups.metric``: ``reward``, ``seq_reward`` and ``seq_final_reward`` are the
    sequence score (verl's summed token-level scores; refused config-side where the KL penalty would
    make ``seq_final_reward`` differ); any other name is a reward extra the reward service returned."""
    if metric in SEQUENCE_REWARD_METRICS:
        return traj.score
    if metric in traj.reward_extra:
        return traj.reward_extra[metric]
    have = ", ".join(sorted(traj.reward_extra)) or "none"
    raise DynamicSamplingError(
        f"algorithm.filter_groups.metric={metric!r}: trajectory {traj.uid} has no reward extra of that "
        f"name (it has: {have}). reward_model.reward_manager=dapo records acc for a reward function that "
        "returns a number; a function that returns a dict gives its own keys; seq_reward is the score"
    )


class GroupFilter:
    """``keep(trajectories)``: whether a complete group is trained on."""

    def __init__(self, metric: str) -> None:
        self.metric = metric

    def __call__(self, trajectories: Sequence[Trajectory]) -> bool:
        return keeps_group([group_metric(t, self.metric) for t in trajectories])


class GenBatches:
    """The prompts one step draws, counted as verl counts its generation batches: ``train_batch_size``
    at the start, one more for each group dropped. verl fails once ``max_num_gen_batches`` batches
    have been generated and too few groups kept; drawing one prompt per dropped group, that is the
    moment a group is dropped with ``max_num_gen_batches * train_batch_size`` prompts drawn."""

    def __init__(self, batch_size: int, max_num_gen_batches: int) -> None:
        self.batch_size = batch_size
        self.max_num_gen_batches = max_num_gen_batches
        self.drawn = batch_size
        self.dropped = 0

    def start_step(self) -> None:
        self.drawn, self.dropped = self.batch_size, 0

    @property
    def num_gen_batches(self) -> int:
        return math.ceil(self.drawn / self.batch_size)

    def draw_for_dropped(self, step: int) -> None:
        """Counts a dropped group and the prompt drawn in its place; raises ``DynamicSamplingError``
        (verl's words) when ``max_num_gen_batches`` batches are spent."""
        self.dropped += 1
        limit = self.max_num_gen_batches
        if limit > 0 and self.drawn >= limit * self.batch_size:
            raise DynamicSamplingError(
                f"num_gen_batches={self.num_gen_batches} >= max_num_gen_batches={limit}. Generated too many. "
                "Please check if your data are too difficult. You could also try set max_num_gen_batches=0 "
                f"to enable endless trials. (step {step}: {self.dropped} of the {self.drawn} prompt groups "
                "drawn had the same algorithm.filter_groups.metric for every sample)"
            )
        self.drawn += 1


async def draw_in_place(
    feeder: PromptFeeder, gen_batches: GenBatches, dropped: Sequence[str], step: int, version: int
) -> list[str]:
    """Enqueues the next prompt of the data in place of each dropped group the feeder still waits
    for (one enqueued again or replaced meanwhile has its successor already); returns the new group
    uids. Raises ``DynamicSamplingError`` past ``max_num_gen_batches``."""
    drawn = []
    for gid in dropped:
        if gid not in feeder.outstanding:
            continue
        gen_batches.draw_for_dropped(step)
        drawn.append(
            await retry_redis_with_deadline(
                lambda gid=gid: feeder.replace(gid, version), "draw a prompt in place of a dropped group"
            )
        )
    return drawn
