"""A reward function's extra values become step metrics (``reward_extra/<name>/mean``): bounded in
number, with names that Prometheus takes as they are, carried through ``select``."""

from __future__ import annotations

import math

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from rlmesh.learner.ppo.batch import (
    MAX_REWARD_EXTRA_KEYS,
    batch_metrics,
    build_batch,
    reward_extra_columns,
    reward_extra_metrics,
    reward_extra_name,
)
from rlmesh.learner.run.sinks import MetricsSinks
from rlmesh.v1.trajectory_pb2 import Trajectory


def traj(uid: str, extra: dict[str, float], score: float = 1.0) -> Trajectory:
    t = Trajectory(uid=uid, group_uid=uid.split("/")[0], prompt_ids=[1, 2], response_ids=[3, 4], score=score)
    t.reward_extra.update(extra)
    return t


def test_the_step_logs_the_mean_of_each_extra_over_the_samples_that_returned_it():
    batch = build_batch(
        [
            traj("g0/0", {"acc": 1.0, "format": 0.5}),
            traj("g0/1", {"acc": 0.0}),
            traj("g1/0", {"acc": 1.0, "format": 1.5}),
        ],
        pad_token_id=0,
    )
    assert batch.reward_extra["acc"].tolist() == [1.0, 0.0, 1.0]
    assert np.isnan(batch.reward_extra["format"][1])
    zeros = torch.zeros_like(batch.token_level_scores)
    metrics = batch_metrics(batch, batch.token_level_scores, zeros, zeros, None, 4, 4)
    assert metrics["reward_extra/acc/mean"] == 2 / 3
    assert metrics["reward_extra/format/mean"] == 1.0  # (0.5 + 1.5) / 2: the sample without it is left out
    assert "critic/score/mean" in metrics  # verl's data metrics are still there

    picked = batch.select([2, 1])
    assert picked.reward_extra["acc"].tolist() == [1.0, 0.0]
    assert picked.reward_extra["format"][0] == 1.5 and np.isnan(picked.reward_extra["format"][1])


def test_a_batch_without_extras_logs_none():
    batch = build_batch([traj("g0/0", {}), traj("g0/1", {})], pad_token_id=0)
    assert batch.reward_extra == {}
    zeros = torch.zeros_like(batch.token_level_scores)
    assert not any(
        k.startswith("reward_extra/") for k in batch_metrics(batch, zeros, zeros, zeros, None, 4, 4)
    )


def test_a_reward_returning_thousands_of_keys_gives_the_first_32_names_in_sorted_order():
    extras = [{f"k{i:05d}": float(i) for i in range(s, 10_000, 7)} for s in range(7)]
    columns = reward_extra_columns(extras)
    assert len(columns) == MAX_REWARD_EXTRA_KEYS == 32
    assert list(columns) == [f"k{i:05d}" for i in range(32)]
    assert columns["k00003"][3] == 3.0 and np.isnan(columns["k00003"][0])
    assert len(reward_extra_metrics(columns)) == 32


def test_names_are_prometheus_safe_and_keys_that_collide_share_one_column():
    assert reward_extra_name("format.ok") == "format_ok"
    assert reward_extra_name("réponse-len") == "r_ponse_len"
    assert reward_extra_name("") == "_"
    assert reward_extra_name("x" * 100) == "x" * 64
    columns = reward_extra_columns([{"a.b": 1.0, "a_b": 2.0}, {"a-b": 3.0}])
    # "a-b" < "a.b" < "a_b": in a sample that has several, the first key in sorted order wins.
    assert list(columns) == ["a_b"] and columns["a_b"].tolist() == [1.0, 3.0]


def test_every_extra_metric_becomes_a_gauge_even_with_keys_whose_gauge_names_collide(tmp_path):
    keys = [
        "acc",
        "format.ok",
        "format-ok",
        "len (tokens)",
        "naïve",
        "1st",
        *(f"z{i:03d}" for i in range(100)),
    ]
    batch = build_batch([traj(f"g{i}/0", {k: float(i) for k in keys}) for i in range(2)], pad_token_id=0)
    metrics = reward_extra_metrics(batch.reward_extra)
    assert len(metrics) == MAX_REWARD_EXTRA_KEYS
    registry = CollectorRegistry()
    sinks = MetricsSinks(
        [], jsonl_path=tmp_path / "metrics.jsonl", registry=registry, project="p", experiment="e"
    )
    sinks.log(1, metrics)  # two metric names for one gauge name ("format.ok", "format-ok") would raise here
    sinks.close()
    assert registry.get_sample_value("rlmesh_learner_reward_extra_acc_mean") == 0.5
    assert registry.get_sample_value("rlmesh_learner_reward_extra_format_ok_mean") == 0.5
    assert registry.get_sample_value("rlmesh_learner_reward_extra_na_ve_mean") == 0.5
    assert registry.get_sample_value("rlmesh_learner_reward_extra_len__tokens__mean") == 0.5
    assert math.isclose(metrics["reward_extra/1st/mean"], 0.5)
    assert registry.get_sample_value("rlmesh_learner_reward_extra_z026_mean") == 0.5  # the 32nd name
    assert registry.get_sample_value("rlmesh_learner_reward_extra_z027_mean") is None
