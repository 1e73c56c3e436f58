import math

import numpy as np
import pytest
import torch

from rlmesh.learner.ppo.batch import (
    BatchError,
    batch_metrics,
    build_batch,
    staleness_metrics,
    validate_trajectory,
)
from rlmesh.v1.common_pb2 import ErrorCode
from rlmesh.v1.trajectory_pb2 import Trajectory

PAD = 9


def traj(
    uid="g0/0",
    prompt=(1, 2, 3),
    response=(4, 5),
    score=1.0,
    rollout=None,
    ref=None,
    group="g0",
    version=3,
    baseline=None,
    tokens=None,
):
    t = Trajectory(uid=uid, group_uid=group, prompt_ids=prompt, response_ids=response, score=score)
    t.policy_version = version
    if tokens is not None:
        t.token_policy_versions.extend(tokens)
    if baseline is not None:
        t.baseline_score = baseline
    if rollout is not None:
        t.rollout_log_probs.extend(rollout)
    if ref is not None:
        t.ref_log_probs.extend(ref)
    return t


def test_layout_is_verls():
    a = traj("g0/0", prompt=(1, 2, 3), response=(4, 5), score=1.0, rollout=(-0.5, -0.25), ref=(-1.0, -2.0))
    b = traj(
        "g1/0", prompt=(7,), response=(6, 5, 4), score=-2.0, ref=(-3.0, -4.0, -5.0), group="g1", version=4
    )
    batch = build_batch([a, b], PAD)

    assert batch.prompts.tolist() == [[1, 2, 3], [PAD, PAD, 7]]  # left-padded
    assert batch.responses.tolist() == [[4, 5, PAD], [6, 5, 4]]  # right-padded
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, PAD], [PAD, PAD, 7, 6, 5, 4]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.rollout_log_probs.tolist() == [[-0.5, -0.25, 0.0], [0.0, 0.0, 0.0]]  # 0 where missing
    assert batch.has_rollout_log_probs.tolist() == [True, False]
    assert batch.ref_log_probs.tolist() == [[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]]
    assert batch.token_level_scores.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]  # on the last token
    assert isinstance(batch.index, np.ndarray) and batch.index.tolist() == ["g0", "g1"]
    assert batch.uids == ["g0/0", "g1/0"]
    assert batch.policy_versions.tolist() == [3, 4]
    assert len(batch) == 2 and batch.prompt_length == 3 and batch.response_length == 3


def test_masks_positions_and_scores_are_verls_formulas_of_the_padded_rows():
    """build_batch derives them from the lengths; verl computes them from the padded rows: the
    attention mask from where the ids are, positions as clip(cumsum(mask) - 1, 0), the score on the
    last response token (place_scores_on_last_token)."""
    from rlmesh.algo import place_scores_on_last_token
    from rlmesh.learner.ppo.batch import compute_position_ids

    rng = np.random.default_rng(0)
    trajs = [
        traj(
            f"g{i}/0",
            prompt=tuple(int(x) for x in rng.integers(0, 8, int(rng.integers(1, 7)))),
            response=tuple(int(x) for x in rng.integers(0, 8, int(rng.integers(1, 9)))),
            score=float(rng.normal()),
            group=f"g{i}",
        )
        for i in range(40)
    ]
    for widths in ({}, {"max_prompt_length": 9, "max_response_length": 11}):
        batch = build_batch(trajs, PAD, **widths)
        width_p = batch.prompt_length
        expected_mask = torch.tensor(
            [[0] * (width_p - len(t.prompt_ids)) + [1] * len(t.prompt_ids) for t in trajs]
        )
        response_mask = torch.tensor(
            [[1] * len(t.response_ids) + [0] * (batch.response_length - len(t.response_ids)) for t in trajs]
        )
        attention = torch.cat([expected_mask, response_mask], dim=1)
        assert torch.equal(batch.attention_mask, attention) and torch.equal(
            batch.response_mask, response_mask
        )
        assert torch.equal(batch.position_ids, compute_position_ids(attention))
        assert torch.equal(batch.token_level_scores, place_scores_on_last_token(batch.scores, response_mask))
        assert batch.attention_mask.dtype == batch.position_ids.dtype == torch.int64


def test_fixed_widths_and_no_ref():
    batch = build_batch([traj()], PAD, max_prompt_length=5, max_response_length=4)
    assert batch.prompts.shape == (1, 5) and batch.responses.shape == (1, 4)
    assert batch.ref_log_probs is None
    with pytest.raises(BatchError, match="max_response_length=1"):
        build_batch([traj()], PAD, max_response_length=1)


def test_select_keeps_rows_aligned():
    batch = build_batch([traj("a", group="ga"), traj("b", response=(1, 2, 3, 4), group="gb")], PAD)
    sub = batch.select([1])
    assert sub.uids == ["b"] and sub.index.tolist() == ["gb"]
    assert torch.equal(sub.responses[0], batch.responses[1])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"score": math.nan}, "score"),
        ({"score": math.inf}, "score"),
        ({"response": ()}, "response_ids"),
        ({"prompt": ()}, "prompt_ids"),
        ({"rollout": (-1.0,)}, "rollout_log_probs"),
        ({"ref": (-1.0, -1.0, -1.0)}, "ref_log_probs"),
        ({"rollout": (-1.0, math.nan)}, "rollout_log_probs"),
        ({"response": (4, -1)}, "response_ids"),
        ({"baseline": math.nan}, "baseline_score"),
        ({"baseline": -math.inf}, "baseline_score"),
        ({"tokens": (3,)}, "token_policy_versions"),  # one version for two tokens
        ({"tokens": (2, 3)}, "token_policy_versions"),  # a token older than policy_version (3)
    ],
)
def test_bad_trajectories_are_refused_naming_uid_and_field(kwargs, field):
    bad = traj("bad/1", **kwargs)
    reason = validate_trajectory(bad)
    assert reason is not None and reason.startswith(field)
    with pytest.raises(BatchError) as info:
        build_batch([traj("ok/0"), bad], PAD)
    assert info.value.uid == "bad/1" and info.value.field == field
    assert "bad/1" in str(info.value) and field in str(info.value)


LIMITS = {"vocab_size": 10, "max_prompt_length": 3, "max_response_length": 2}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"response": (4, 10)}, "response_ids"),  # token id == vocab size: past the embedding
        ({"prompt": (1, 99_999_999, 3)}, "prompt_ids"),
        ({"prompt": (1, 2, 3, 4)}, "prompt_ids"),  # past max_prompt_length
        ({"response": (4, 5, 6)}, "response_ids"),
        ({"score": 1e30}, "score"),
        ({"score": -2e6}, "score"),
        ({"baseline": 1e30}, "baseline_score"),
        ({"rollout": (-0.5, 0.7)}, "rollout_log_probs"),  # a probability above 1
        ({"ref": (-1e30, -1.0)}, "ref_log_probs"),
    ],
)
def test_values_no_step_can_take_are_refused_before_they_reach_one(kwargs, field):
    reason = validate_trajectory(traj("bad/1", **kwargs), **LIMITS)
    assert reason is not None and reason.startswith(field)


def test_the_limits_are_inclusive_and_rounding_above_zero_is_a_log_prob():
    ok = traj(prompt=(0, 1, 9), response=(9, 8), score=1e6, rollout=(0.0, 5e-4), ref=(-9000.0, -1.0))
    assert validate_trajectory(ok, **LIMITS) is None
    # Without the limits given, the vocabulary and lengths are not checked.
    assert validate_trajectory(traj(prompt=(1, 2, 3, 4), response=(4, 10))) is None


def test_an_oversized_trajectory_is_refused():
    big = traj(response=(4, 5))
    big.response_text = "x" * 2000
    assert validate_trajectory(big, max_bytes=4096) is None
    assert validate_trajectory(big, max_bytes=1024).startswith("trajectory: ")


def test_error_set_is_refused():
    t = traj("err/0")
    t.error.code = ErrorCode.ERROR_CODE_TIMEOUT
    t.error.message = "reward timed out"
    t.error.source = "reward:arithmetic"
    assert "reward timed out" in validate_trajectory(t)
    with pytest.raises(BatchError, match=r"err/0.*error"):
        build_batch([t], PAD)


def test_valid_trajectory_passes():
    assert validate_trajectory(traj(rollout=(-1.0, -2.0), ref=(-1.0, -1.5))) is None


def test_ref_log_probs_on_some_trajectories_only_is_refused():
    with pytest.raises(BatchError, match=r"b/0.*ref_log_probs"):
        build_batch([traj("a/0", ref=(-1.0, -1.0)), traj("b/0")], PAD)


def test_a_run_without_reference_ignores_ref_log_probs_and_one_with_it_needs_them():
    mixed = [traj("a/0", ref=(-1.0, -1.0)), traj("b/0")]
    assert build_batch(mixed, PAD, with_ref=False).ref_log_probs is None
    with pytest.raises(BatchError, match=r"b/0.*ref_log_probs: missing"):
        build_batch(mixed, PAD, with_ref=True)


def test_a_run_that_needs_the_reference_refuses_samples_without_it_naming_the_replica():
    t = traj()
    t.replica_id = "rollout-7"
    assert validate_trajectory(t) is None
    reason = validate_trajectory(t, needs_ref=True)
    assert reason.startswith("ref_log_probs: missing") and "rollout-7" in reason
    assert validate_trajectory(traj(ref=(-1.0, -1.5)), needs_ref=True) is None


def test_greedy_baselines_become_verls_reward_baselines_column():
    rows = [traj("g0/0", baseline=0.25), traj("g1/0", group="g1", baseline=-1.5), traj("g0/1", baseline=0.25)]
    batch = build_batch(rows, PAD)
    assert batch.reward_baselines.tolist() == [0.25, -1.5, 0.25]
    assert batch.select([1, 0]).reward_baselines.tolist() == [-1.5, 0.25]
    # A run with no baselines (every estimator but remax) carries none.
    assert build_batch([traj()], PAD).reward_baselines is None
    assert build_batch(rows, PAD, with_baselines=False).reward_baselines is None


def test_a_baseline_on_some_trajectories_only_is_refused():
    mixed = [traj("a/0", baseline=0.5), traj("b/0")]
    with pytest.raises(BatchError, match=r"b/0.*baseline_score: missing"):
        build_batch(mixed, PAD)
    with pytest.raises(BatchError, match=r"b/0.*baseline_score: missing"):
        build_batch(mixed, PAD, with_baselines=True)


def test_a_remax_run_refuses_samples_without_a_baseline_naming_the_replica():
    t = traj()
    t.replica_id = "rollout-3"
    assert validate_trajectory(t) is None
    reason = validate_trajectory(t, needs_baseline=True)
    assert reason.startswith("baseline_score: missing") and "remax" in reason and "rollout-3" in reason
    assert validate_trajectory(traj(baseline=0.0), needs_baseline=True) is None


def test_staleness_counts_versions_behind_the_trained_weights():
    batch = build_batch(
        [traj("g0/0", version=4), traj("g0/1", version=3), traj("g1/0", group="g1", version=4)], PAD
    )
    assert staleness_metrics(batch, 4) == {
        "training/staleness/mean": pytest.approx(1 / 3),
        "training/staleness/max": 1.0,
        "training/staleness/min": 0.0,
    }
    on_policy = staleness_metrics(batch.select([0, 2]), 4)
    assert on_policy["training/staleness/max"] == on_policy["training/staleness/mean"] == 0.0


def test_staleness_is_per_token_for_a_response_sampled_across_an_update():
    across = traj("g0/0", response=(4, 5, 6, 7), version=2, tokens=(2, 2, 3, 4))
    fresh = traj("g0/1", response=(4,), version=4)  # its padding (3 positions) counts for nothing
    batch = build_batch([across, fresh], PAD)
    assert batch.token_policy_versions[0].tolist() == [2, 2, 3, 4]
    assert staleness_metrics(batch, 4) == {
        "training/staleness/mean": pytest.approx((2 + 2 + 1 + 0 + 0) / 5),
        "training/staleness/max": 2.0,
        "training/staleness/min": 0.0,
    }
    assert validate_trajectory(across) is None


def test_batch_metrics_lengths_and_scores_are_the_samples_against_the_configured_maxima():
    rows = [
        traj("g0/0", prompt=(1, 2, 3), response=(4, 5, 6), score=1.0),
        traj("g0/1", prompt=(1, 2, 3), response=(4,), score=0.0),
        traj("g1/0", prompt=(7,), response=(6, 5), score=-0.5, group="g1"),
    ]
    batch = build_batch(rows, PAD)  # widths: the longest prompt (3) and response (3)
    zeros = torch.zeros_like(batch.token_level_scores)
    metrics = batch_metrics(batch, batch.token_level_scores, zeros, zeros, None, 3, 4)
    responses = [len(t.response_ids) for t in rows]
    prompts = [len(t.prompt_ids) for t in rows]
    assert metrics["critic/score/mean"] == pytest.approx(sum(t.score for t in rows) / len(rows))
    assert metrics["critic/score/min"] == min(t.score for t in rows)
    assert metrics["response_length/mean"] == pytest.approx(sum(responses) / len(rows))
    assert metrics["prompt_length/max"] == max(prompts) and metrics["prompt_length/min"] == min(prompts)
    # clipped at the configured maxima, not at the batch's width: a 3-token prompt is not clipped at 4
    assert metrics["response_length/clip_ratio"] == pytest.approx(sum(n == 3 for n in responses) / len(rows))
    assert metrics["prompt_length/clip_ratio"] == 0.0
    assert metrics["response/aborted_ratio"] == 0.0  # empty responses never reach a batch
    assert "critic/values/mean" not in metrics


def _random_group(rng, g, n=3):
    out = []
    for i in range(n):
        lr = int(rng.integers(1, 12))
        tokens = sorted(int(v) for v in rng.integers(3, 6, lr)) if rng.random() < 0.5 else None
        out.append(
            traj(
                f"g{g}/{i}",
                prompt=tuple(int(x) for x in rng.integers(0, 8, int(rng.integers(1, 9)))),
                response=tuple(int(x) for x in rng.integers(0, 8, lr)),
                score=float(rng.normal()),
                rollout=tuple(float(-x) for x in rng.random(lr)) if rng.random() < 0.7 else None,
                ref=tuple(float(-x) for x in rng.random(lr)),
                group=f"g{g}",
                version=3,
                baseline=float(g),
                tokens=tokens,
            )
        )
        out[-1].reward_extra[f"k{i % 2}"] = float(i)
    return out


def _assert_same_batch(a, b):
    for name in (
        "prompts",
        "responses",
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_mask",
        "rollout_log_probs",
        "ref_log_probs",
        "token_level_scores",
        "scores",
        "has_rollout_log_probs",
        "reward_baselines",
    ):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    for name in ("index", "policy_versions", "token_policy_versions"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.uids == b.uids and a.data_sources == b.data_sources
    assert a.reward_extra.keys() == b.reward_extra.keys()
    for name in a.reward_extra:
        assert np.array_equal(a.reward_extra[name], b.reward_extra[name], equal_nan=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batch_written_a_group_at_a_time_is_the_batch_padded_at_once(seed):
    """Groups whose prompts and responses grow longer and shorter as they come: every row written
    before a longer one is padded out to it, and the views narrowed to the longest placed."""
    from rlmesh.algo import place_scores_on_last_token
    from rlmesh.learner.ppo.batch import BatchBuilder, compute_position_ids

    rng = np.random.default_rng(seed)
    groups = [_random_group(rng, g) for g in range(7)]
    builder = BatchBuilder(PAD, rows=24, max_prompt_length=10, max_response_length=14, with_ref=True)
    for g in groups:
        builder.add(g)
    batch = builder.finish()
    flat = [t for g in groups for t in g]
    _assert_same_batch(batch, build_batch(flat, PAD))
    assert batch.prompt_length == max(len(t.prompt_ids) for t in flat) < 10
    assert batch.response_length == max(len(t.response_ids) for t in flat) < 14
    assert torch.equal(batch.position_ids, compute_position_ids(batch.attention_mask))
    assert torch.equal(
        batch.token_level_scores, place_scores_on_last_token(batch.scores, batch.response_mask)
    )
    assert batch.token_policy_versions.min() >= 3


def test_a_pickled_batch_carries_its_rows_not_the_builders_buffers():
    import pickle

    from rlmesh.learner.ppo.batch import BatchBuilder

    builder = BatchBuilder(PAD, rows=64, max_prompt_length=4096, max_response_length=4096, with_ref=True)
    builder.add(_random_group(np.random.default_rng(0), 0))
    batch = builder.finish()
    data = pickle.dumps(batch)
    assert len(data) < 64 * 1024  # the buffers are 64 x 8192 x 8 bytes each: 4 MiB
    _assert_same_batch(pickle.loads(data), batch)


def test_a_builder_refuses_what_does_not_fit_and_keeps_what_it_has():
    from rlmesh.learner.ppo.batch import BatchBuilder

    builder = BatchBuilder(PAD, rows=3, max_prompt_length=4, max_response_length=3, with_ref=True)
    builder.add([traj("a", ref=(-1.0, -1.0))])
    with pytest.raises(BatchError, match=r"'b'.*response_ids.*max_response_length=3"):
        builder.add([traj("c", ref=(-1.0, -1.0)), traj("b", response=(1, 2, 3, 4), ref=(-1.0,) * 4)])
    with pytest.raises(BatchError, match=r"'d'.*ref_log_probs.*missing"):
        builder.add([traj("d")])
    batch = builder.finish()
    assert batch.uids == ["a"] and batch.response_length == 2 and batch.prompt_length == 3
    with pytest.raises(ValueError, match="at least one trajectory"):
        BatchBuilder(PAD, rows=1, max_prompt_length=1, max_response_length=1, with_ref=False).finish()


def test_kept_buffers_are_written_again_only_once_nothing_holds_their_batch():
    """A batch built into the arrays of a longer one before it is the batch padded at once: the
    region the last batch used is cleared; arrays a live batch still views are never taken."""
    from rlmesh.learner.ppo.batch import BatchBuffers, BatchBuilder

    buffers = BatchBuffers()

    def built(trajectories):
        builder = BatchBuilder(
            PAD, rows=4, max_prompt_length=8, max_response_length=8, with_ref=True, buffers=buffers
        )
        builder.add(trajectories)
        return builder.finish()

    def long(uid):
        return traj(uid, prompt=(1,) * 6, response=(2,) * 6, score=5.0, rollout=(-0.1,) * 6, ref=(-0.2,) * 6)

    first = built([long("a"), long("b")])
    held = built([long("c"), long("d")])  # the first batch is alive: new arrays
    assert buffers.reused == 0 and first.input_ids.data_ptr() != held.input_ids.data_ptr()
    del first, held
    # One row as long as the last batch's, one shorter without rollout log-probs: its padding is
    # where the last batch wrote.
    now = [long("e"), traj("f", prompt=(3,), response=(4,), score=1.0, ref=(-0.5,), version=4)]
    again = built(now)
    assert buffers.reused == 1
    _assert_same_batch(again, build_batch(now, PAD))


def test_more_rows_than_asked_for_grow_the_batch():
    """A group larger than the run's n (a replica told another n) is trained on whole."""
    from rlmesh.learner.ppo.batch import BatchBuffers, BatchBuilder

    rng = np.random.default_rng(5)
    groups = [_random_group(rng, g, n=3) for g in range(3)]
    builder = BatchBuilder(
        PAD, rows=4, max_prompt_length=10, max_response_length=14, with_ref=True, buffers=BatchBuffers()
    )
    for g in groups:
        builder.add(g)
    _assert_same_batch(builder.finish(), build_batch([t for g in groups for t in g], PAD))
