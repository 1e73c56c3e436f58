"""DAPO's dynamic sampling without Redis: which groups are kept (verl's rule, recomputed here), what a
sample's metric is, the count of generation batches and the limit on them, and the config keys."""

from __future__ import annotations

import math
import random

import pytest

from rlmesh.config import ConfigError, load_config
from rlmesh.learner.run.dynamic_sampling import (
    DynamicSamplingError,
    GenBatches,
    GroupFilter,
    group_metric,
    keeps_group,
    kept_groups,
)
from rlmesh.v1 import trajectory_pb2


def verl_keeps(values: list[float]) -> bool:
    """verl's DAPO trainer: kept when the population std of the group's metric is > 0 or the group
    holds one sample; written out as a loop."""
    if len(values) == 1:
        return True
    if not values:
        return False
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(variance) > 0


GROUPS = {
    "all-zero": [0.0, 0.0, 0.0, 0.0],
    "all-one": [1.0, 1.0, 1.0, 1.0],
    "one-right": [0.0, 0.0, 1.0, 0.0],
    "single": [0.0],
    "single-one": [1.0],
    "penalised": [0.9, 0.9, 0.85, 0.9],
    "negative-uniform": [-1.0, -1.0],
    "mixed-sign": [-1.0, 1.0],
    "tiny-spread": [0.5, 0.5 + 1e-9],
    "empty": [],
}


def test_kept_groups_are_verl_s():
    assert kept_groups(GROUPS) == [gid for gid, values in GROUPS.items() if verl_keeps(values)]
    for values in GROUPS.values():
        assert keeps_group(values) == verl_keeps(values), values
    # The rule could fail both ways: some groups are kept and some dropped.
    assert {keeps_group(v) for v in GROUPS.values()} == {True, False}


def test_random_groups_follow_verl_s_rule():
    rng = random.Random(0)
    for _ in range(500):
        size = rng.randint(1, 6)
        values = [float(rng.choice([0, 1])) if rng.random() < 0.7 else rng.random() for _ in range(size)]
        assert keeps_group(values) == verl_keeps(values), values


def traj(uid: str, seq_score: float, **extra: float) -> trajectory_pb2.Trajectory:
    t = trajectory_pb2.Trajectory(uid=uid, group_uid=uid.split("/")[0], score=seq_score)
    t.reward_extra.update(extra)
    return t


def test_metrics_map_onto_what_a_trajectory_carries():
    t = traj("g/0", 0.75, acc=1.0, score=1.0, overlong_reward=-0.25)
    # verl's seq_reward / seq_final_reward / reward: the summed token scores, i.e. the sequence score
    # (overlong penalty included); any other name: a reward extra.
    for name in ("reward", "seq_reward", "seq_final_reward"):
        assert group_metric(t, name) == 0.75
    assert group_metric(t, "acc") == 1.0
    assert group_metric(t, "score") == 1.0
    assert group_metric(t, "overlong_reward") == -0.25
    with pytest.raises(
        DynamicSamplingError, match=r"metric='pred'.*no reward extra.*acc, overlong_reward, score"
    ):
        group_metric(t, "pred")


def test_group_filter_compares_the_configured_metric():
    # Same accuracy, different scores (the overlong penalty): acc drops the group, seq_reward keeps it.
    group = [traj("g/0", 1.0, acc=1.0), traj("g/1", 0.6, acc=1.0)]
    assert not GroupFilter("acc")(group)
    assert GroupFilter("seq_reward")(group)


def verl_generation(outcomes: list[bool], batch: int, max_batches: int) -> tuple[list[int], int] | None:
    """verl's DAPO loop over a prompt stream whose i-th prompt is kept iff ``outcomes[i]``: whole
    generation batches of ``batch`` prompts until ``batch`` groups are kept, then the first ``batch``
    kept ones. (trained prompt indices, num_gen_batches), or None where verl raises."""
    kept: list[int] = []
    gen_batches = 0
    start = 0
    while True:
        gen_batches += 1
        kept += [i for i in range(start, start + batch) if outcomes[i]]
        start += batch
        if len(kept) >= batch:
            return kept[:batch], gen_batches
        if 0 < max_batches <= gen_batches:
            return None


def streamed(outcomes: list[bool], batch: int, max_batches: int) -> tuple[list[int], int] | None:
    """rlmesh's: ``batch`` prompts in flight, one drawn in place of each dropped group, counted by
    ``GenBatches``; groups resolve in a shuffled order, as replicas finish them."""
    counter = GenBatches(batch, max_batches)
    counter.start_step()
    rng = random.Random(len(outcomes))
    in_flight, drawn, kept = list(range(batch)), batch, []
    while len(kept) < batch:
        i = in_flight.pop(rng.randrange(len(in_flight)))
        if outcomes[i]:
            kept.append(i)
            continue
        try:
            counter.draw_for_dropped(step=1)
        except DynamicSamplingError:
            return None
        in_flight.append(drawn)
        drawn += 1
    assert counter.drawn == drawn
    return sorted(kept), counter.num_gen_batches


@pytest.mark.parametrize("max_batches", [0, 1, 2, 3])
def test_refilling_one_prompt_per_dropped_group_trains_what_verl_trains(max_batches):
    batch = 4
    rng = random.Random(max_batches)
    for _ in range(300):
        share = rng.choice([0.2, 0.5, 0.9])
        outcomes = [rng.random() < share for _ in range(400)]
        assert streamed(outcomes, batch, max_batches) == verl_generation(outcomes, batch, max_batches)


def test_a_spent_limit_fails_with_verl_s_message():
    counter = GenBatches(2, 2)
    counter.start_step()
    counter.draw_for_dropped(step=5)
    counter.draw_for_dropped(step=5)  # 4 prompts drawn: two batches
    assert counter.num_gen_batches == 2
    with pytest.raises(
        DynamicSamplingError, match=r"num_gen_batches=2 >= max_num_gen_batches=2\. Generated too many"
    ):
        counter.draw_for_dropped(step=5)
    counter.start_step()  # the next step counts afresh
    assert (counter.drawn, counter.num_gen_batches) == (2, 1)


def test_filter_groups_config_keys():
    cfg = load_config(
        None, ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=10"]
    )
    fg = cfg.algorithm.filter_groups
    assert (fg.enable, fg.metric, fg.max_num_gen_batches) == (True, "reward", 10)
    off = load_config(
        None, ["algorithm.filter_groups=null"]
    ).algorithm.filter_groups  # verl's AlgoConfig default
    assert not off.enable
    with pytest.raises(ConfigError, match="metric must be set"):
        load_config(None, ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=null"])
    with pytest.raises(ConfigError, match="seq_final_reward with use_kl_in_reward"):
        load_config(
            None,
            [
                "algorithm.filter_groups.enable=True",
                "algorithm.filter_groups.metric=seq_final_reward",
                "algorithm.use_kl_in_reward=True",
            ],
        )
