import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.algo import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    compute_advantage,
    compute_gae_advantage_return,
    compute_gae_raw_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    group_indices,
    register_adv_est,
)
from rlmesh.algo.advantages import compute_gpg_outcome_advantage

F64 = torch.float64


def _whiten(xs):
    """masked_whiten written out on a Python list of the valid values."""
    mean = statistics.fmean(xs)
    scale = 1 / math.sqrt(statistics.variance(xs) + 1e-8)
    return [(x - mean) * scale for x in xs]


# ---------------------------------------------------------------- GAE


def test_gae_by_hand():
    # gamma = 0.9, lam = 0.8, so gamma * lam = 0.72.
    # Row 0 (three valid tokens), rewards [0, 0, 1], values [0.5, 0.6, 0.7]:
    #   d2 = 1 - 0.7 = 0.3                    A2 = 0.3
    #   d1 = 0.9 * 0.7 - 0.6 = 0.03           A1 = 0.03 + 0.72 * 0.3 = 0.246
    #   d0 = 0.9 * 0.6 - 0.5 = 0.04           A0 = 0.04 + 0.72 * 0.246 = 0.21712
    # Row 1 (last token is padding holding junk), rewards [0, 2, 5], values [1, 1, 9]:
    #   t=2 masked: carried state stays 0     A2 = 0
    #   d1 = 2 - 1 = 1                        A1 = 1
    #   d0 = 0.9 * 1 - 1 = -0.1               A0 = -0.1 + 0.72 * 1 = 0.62
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    raw, raw_returns = compute_gae_raw_advantage_return(rewards, values, mask, 0.9, 0.8)
    assert raw.tolist() == [pytest.approx([0.21712, 0.246, 0.3]), pytest.approx([0.62, 1.0, 0.0])]
    assert raw_returns.tolist() == [pytest.approx([0.71712, 0.846, 1.0]), pytest.approx([1.62, 2.0, 9.0])]

    advantages, returns = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    expected = _whiten([0.21712, 0.246, 0.3, 0.62, 1.0])
    assert advantages[mask.bool()].tolist() == pytest.approx(expected)
    assert torch.equal(returns, raw_returns)


def test_gae_skips_masked_tokens_inside_a_response():
    # Multi-turn: token 1 is an observation. Rewards [0, 7, 1], values [0.5, 100, 0.7], mask [1, 0, 1]:
    #   A2 = 1 - 0.7 = 0.3; t=1 carries A = 0.3 and V_next = 0.7;
    #   d0 = 0.9 * 0.7 - 0.5 = 0.13, A0 = 0.13 + 0.72 * 0.3 = 0.346.
    rewards = torch.tensor([[0.0, 7.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 100.0, 0.7]], dtype=F64)
    mask = torch.tensor([[1, 0, 1]])
    raw, _ = compute_gae_raw_advantage_return(rewards, values, mask, 0.9, 0.8)
    assert raw.tolist() == [pytest.approx([0.346, 0.3, 0.3])]


def test_gae_equals_a_per_step_loop_bit_for_bit():
    # The loop as verl writes it, with 0/1 mask arithmetic instead of torch.where.
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 11, generator=gen)
    values = torch.randn(6, 11, generator=gen)
    mask = (torch.rand(6, 11, generator=gen) > 0.3).float()
    next_values, last, out = 0, 0, []
    for t in reversed(range(11)):
        delta = rewards[:, t] + 0.99 * next_values - values[:, t]
        gae = delta + 0.99 * 0.95 * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = gae * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    expected = torch.stack(out[::-1], dim=1)
    raw, _ = compute_gae_raw_advantage_return(rewards, values, mask, 0.99, 0.95)
    assert torch.equal(raw, expected)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bs=st.integers(1, 4), length=st.integers(1, 10))
def test_gae_with_gamma_lam_one_is_reward_to_go_minus_values(seed, bs, length):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(bs, length, generator=gen, dtype=F64)
    values = torch.randn(bs, length, generator=gen, dtype=F64)
    mask = (torch.rand(bs, length, generator=gen) > 0.3).long()
    raw, _ = compute_gae_raw_advantage_return(rewards, values, mask, 1.0, 1.0)
    valid_rewards = rewards * mask
    reward_to_go = valid_rewards.flip(-1).cumsum(-1).flip(-1)
    expected = reward_to_go - values
    valid = mask.bool()
    torch.testing.assert_close(raw[valid], expected[valid])


# ---------------------------------------------------------------- group estimators

# Scores per sample, put on the last token of a 2-token response.
SCORES = [1.0, 0.5, 0.0, 2.0, 1.0, 2.0]
INDEX = np.array(["a", "b", "a", "c", "a", "c"], dtype=object)
# group a: [1, 0, 1] (mean 2/3, unbiased std sqrt(1/3)); group b: [0.5] alone; group c: [2, 2] (std 0)


def _rewards(scores=SCORES):
    rewards = torch.zeros(len(scores), 2, dtype=F64)
    rewards[:, 1] = torch.tensor(scores, dtype=F64)
    return rewards


def test_grpo_by_hand():
    mask = torch.ones(6, 2)
    advantages, returns = compute_grpo_outcome_advantage(_rewards(), mask, INDEX)
    std_a = math.sqrt(1 / 3)
    expected = [
        (1 - 2 / 3) / (std_a + 1e-6),
        0.5 / (1 + 1e-6),  # group of one: mean 0, std 1
        (0 - 2 / 3) / (std_a + 1e-6),
        0.0,  # equal scores: 0 / (0 + eps)
        (1 - 2 / 3) / (std_a + 1e-6),
        0.0,
    ]
    assert advantages[:, 0].tolist() == pytest.approx(expected)
    assert torch.equal(advantages[:, 0], advantages[:, 1])
    assert returns is advantages


def test_grpo_without_std_normalisation():
    advantages, _ = compute_grpo_outcome_advantage(
        _rewards(), torch.ones(6, 2), INDEX, norm_adv_by_std_in_grpo=False
    )
    assert advantages[:, 0].tolist() == pytest.approx([1 / 3, 0.5, -2 / 3, 0.0, 1 / 3, 0.0])


def test_grpo_masks_the_broadcast_advantage():
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [0, 0]])
    advantages, _ = compute_grpo_outcome_advantage(_rewards([1.0, 0.5, 0.0, 2.0, 1.0, 0.0]), mask, INDEX)
    assert advantages[1, 1].item() == 0.0
    assert advantages[5].tolist() == [0.0, 0.0]


def test_grpo_equals_verl_style_per_sample_loop_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(12, generator=gen)
    index = np.array([str(i % 4) for i in range(12)], dtype=object)
    index[11] = "alone"
    rewards = torch.zeros(12, 3)
    rewards[:, 2] = scores
    groups: dict[str, list[torch.Tensor]] = {}
    for i in range(12):
        groups.setdefault(index[i], []).append(scores[i])
    expected = scores.clone()
    for i in range(12):
        members = groups[index[i]]
        if len(members) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = torch.mean(torch.stack(members)), torch.std(torch.stack(members))
        expected[i] = (scores[i] - mean) / (std + 1e-6)
    advantages, _ = compute_grpo_outcome_advantage(rewards, torch.ones(12, 3), index)
    assert torch.equal(advantages[:, 0], expected)


def test_rloo_by_hand():
    # A_i = s_i - mean of the other samples of the group; a group of one keeps its score.
    advantages, returns = compute_rloo_outcome_advantage(_rewards(), torch.ones(6, 2), INDEX)
    assert advantages[:, 1].tolist() == pytest.approx([0.5, 0.5, -1.0, 0.0, 0.5, 0.0])
    assert returns is advantages


def test_gpg_by_hand():
    # SCORES: 5 of 6 non-zero, alpha = 6/5; group means a 2/3, b (alone) 0, c 2.
    advantages, returns = compute_gpg_outcome_advantage(_rewards(), torch.ones(6, 2), INDEX)
    alpha = 6 / 5
    expected = [alpha / 3, alpha * 0.5, -alpha * 2 / 3, 0.0, alpha / 3, 0.0]
    assert advantages[:, 1].tolist() == pytest.approx(expected)
    assert advantages[:, 0].tolist() == pytest.approx(expected)  # broadcast over the response
    assert returns is advantages


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_equals_verls_definition(seed):
    # verl's compute_gpg_outcome_advantage, as a loop: alpha = bsz / max(1, #non-zero scores),
    # A_i = alpha * (s_i - mean of its group) / f_norm, a group of one has mean 0.
    gen = torch.Generator().manual_seed(seed)
    bsz, width = 12, 5
    scores = torch.randint(0, 3, (bsz,), generator=gen).to(F64)
    index = np.array([str(i // 3) for i in range(bsz - 1)] + ["alone"], dtype=object)
    mask = torch.ones(bsz, width)
    mask[3, 3:] = 0
    rewards = torch.zeros(bsz, width, dtype=F64)
    for i in range(bsz):
        rewards[i, int(mask[i].sum()) - 1] = scores[i]
    nonzero = sum(1 for s in scores.tolist() if s != 0)
    alpha = bsz / max(1, nonzero)
    expected = torch.zeros(bsz, width, dtype=F64)
    for i in range(bsz):
        group = [scores[j].item() for j in range(bsz) if index[j] == index[i]]
        mean = sum(group) / len(group) if len(group) > 1 else 0.0
        for t in range(width):
            expected[i, t] = alpha * (scores[i].item() - mean) / 2.0 * mask[i, t].item()
    advantages, _ = compute_gpg_outcome_advantage(rewards, mask, index, f_norm=2.0)
    torch.testing.assert_close(advantages, expected)
    via_registry, _ = compute_advantage("gpg", token_level_rewards=rewards, response_mask=mask, index=index)
    torch.testing.assert_close(via_registry, compute_gpg_outcome_advantage(rewards, mask, index)[0])


def test_reinforce_plus_plus_by_hand():
    # gamma = 0.5. Row 0 rewards [0, 0, 1] -> G = [0.25, 0.5, 1].
    # Row 1 rewards [0, 1, 5] with the last token padding -> G = [0.5, 1, 5]; padding resets G.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 0.5)
    assert returns.tolist() == [pytest.approx([0.25, 0.5, 1.0]), pytest.approx([0.5, 1.0, 5.0])]
    expected = _whiten([0.25, 0.5, 1.0, 0.5, 1.0])
    assert advantages[mask.bool()].tolist() == pytest.approx(expected)
    assert advantages[1, 2].item() == 0.0


def test_reinforce_plus_plus_baseline_by_hand():
    # Centred scores: a -> [1/3, -2/3, 1/3], b alone -> 0.5, c -> [0, 0]; each on both tokens,
    # then whitened over all 12 valid tokens.
    advantages, returns = compute_reinforce_plus_plus_baseline_outcome_advantage(
        _rewards(), torch.ones(6, 2), INDEX
    )
    centred = [1 / 3, 0.5, -2 / 3, 0.0, 1 / 3, 0.0]
    whitened = _whiten([c for c in centred for _ in range(2)])
    assert advantages.flatten().tolist() == pytest.approx(whitened)
    assert returns is advantages


# ---------------------------------------------------------------- ReMax


def _remax_by_definition(rewards, baselines, mask):
    """verl's ReMax written out per sample and token: R_t = sum over t' >= t of m_t' r_t', and
    A_t = R_t - b (times m_t)."""
    bs, length = rewards.shape
    advantages = [[0.0] * length for _ in range(bs)]
    returns = [[0.0] * length for _ in range(bs)]
    for i in range(bs):
        for t in range(length):
            r = sum(float(rewards[i, u]) for u in range(t, length) if mask[i, u])
            returns[i][t] = r
            advantages[i][t] = r - float(baselines[i]) * int(mask[i, t])
    return advantages, returns


def test_remax_by_hand():
    # Row 0: rewards [0, 0, 1], baseline 0.25 -> R = [1, 1, 1], A = [0.75, 0.75, 0.75].
    # Row 1: rewards [0, 2, 5] with the last token padding, baseline 1.5 -> R = [2, 2, 0],
    # A = [0.5, 0.5, 0] (no baseline on padding).
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = compute_remax_outcome_advantage(rewards, torch.tensor([0.25, 1.5], dtype=F64), mask)
    assert returns.tolist() == [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]
    assert advantages.tolist() == [[0.75, 0.75, 0.75], [0.5, 0.5, 0.0]]


@pytest.mark.parametrize("seed", range(4))
def test_remax_with_kl_in_reward_equals_the_definition(seed):
    # KL in the reward: r_t = -beta * (log pi - log pi_ref) on every token, plus the score on the
    # last valid one; the baseline is the greedy response's score alone (no KL), as in verl.
    gen = torch.Generator().manual_seed(seed)
    bs, length, beta = 5, 7, 0.1
    lengths = torch.randint(1, length + 1, (bs,), generator=gen)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    mask[0, 2] = 0  # a multi-turn observation token inside row 0's response
    logp, ref = (
        torch.randn(bs, length, generator=gen, dtype=F64),
        torch.randn(bs, length, generator=gen, dtype=F64),
    )
    scores = torch.rand(bs, generator=gen, dtype=F64)
    baselines = torch.rand(bs, generator=gen, dtype=F64)
    rewards = -beta * (logp - ref) * mask
    for i in range(bs):
        rewards[i, int(lengths[i]) - 1] += scores[i]
    advantages, returns = compute_remax_outcome_advantage(rewards, baselines, mask)
    expected_adv, expected_ret = _remax_by_definition(rewards, baselines, mask)
    assert advantages.tolist() == [pytest.approx(row) for row in expected_adv]
    assert returns.tolist() == [pytest.approx(row) for row in expected_ret]


def test_remax_through_compute_advantage_needs_the_baselines():
    rewards, mask = _rewards(), torch.ones(6, 2)
    baselines = torch.linspace(0, 1, 6, dtype=F64)
    adv, ret = compute_advantage("remax", rewards, mask, reward_baselines=baselines, index=INDEX, gamma=0.5)
    direct_adv, direct_ret = compute_remax_outcome_advantage(rewards, baselines, mask)
    assert torch.equal(adv, direct_adv) and torch.equal(ret, direct_ret)
    with pytest.raises(ValueError, match="needs 'reward_baselines'"):
        compute_advantage("remax", rewards, mask, index=INDEX)


@pytest.mark.parametrize(
    "fn",
    [
        compute_grpo_outcome_advantage,
        compute_rloo_outcome_advantage,
        compute_reinforce_plus_plus_baseline_outcome_advantage,
    ],
)
def test_group_estimators_accept_tensor_and_list_index(fn):
    mask = torch.ones(6, 2)
    from_numpy, _ = fn(_rewards(), mask, INDEX)
    from_list, _ = fn(_rewards(), mask, list(INDEX))
    from_tensor, _ = fn(_rewards(), mask, torch.tensor([0, 1, 0, 2, 0, 2]))
    assert torch.equal(from_numpy, from_list)
    assert torch.equal(from_numpy, from_tensor)


def test_group_estimator_rejects_index_of_wrong_length():
    with pytest.raises(ValueError, match="index has 2 entries"):
        compute_grpo_outcome_advantage(_rewards(), torch.ones(6, 2), np.array(["a", "b"]))


def test_group_indices_keep_batch_order():
    assert group_indices(np.array([3, 1, 3, 2, 1])) == [[0, 2], [1, 4], [3]]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bs=st.integers(2, 8),
    length=st.integers(2, 6),
    junk=st.sampled_from([float("nan"), 1e6, -3.0]),
)
def test_masked_positions_never_change_advantages(seed, bs, length, junk):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(bs, length, generator=gen, dtype=F64)
    values = torch.randn(bs, length, generator=gen, dtype=F64)
    mask = (torch.rand(bs, length, generator=gen) > 0.3).long()
    mask[:, 0] = 1
    index = np.array([str(int(i)) for i in torch.randint(0, 3, (bs,), generator=gen)], dtype=object)
    valid = mask.bool()
    junk_full = torch.full_like(rewards, junk)
    dirty_rewards = torch.where(valid, rewards, junk_full)
    dirty_values = torch.where(valid, values, junk_full)
    calls = [
        lambda r, v: compute_gae_advantage_return(r, v, mask, 0.99, 0.95),
        lambda r, v: compute_grpo_outcome_advantage(r, mask, index),
        lambda r, v: compute_rloo_outcome_advantage(r, mask, index),
        lambda r, v: compute_reinforce_plus_plus_outcome_advantage(r, mask, 0.99),
        lambda r, v: compute_reinforce_plus_plus_baseline_outcome_advantage(r, mask, index),
        lambda r, v: compute_remax_outcome_advantage(r, v[:, 0], mask),
    ]
    for call in calls:
        clean_adv, clean_ret = call(rewards, values)
        dirty_adv, dirty_ret = call(dirty_rewards, dirty_values)
        assert torch.equal(clean_adv[valid], dirty_adv[valid])
        assert torch.equal(clean_ret[valid], dirty_ret[valid])


# ---------------------------------------------------------------- registry


def test_registry_holds_the_built_in_estimators():
    assert get_adv_estimator_fn("gae") is compute_gae_advantage_return
    assert get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage
    assert get_adv_estimator_fn("rloo") is compute_rloo_outcome_advantage
    assert get_adv_estimator_fn("reinforce_plus_plus") is compute_reinforce_plus_plus_outcome_advantage
    assert (
        get_adv_estimator_fn(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
        is compute_reinforce_plus_plus_baseline_outcome_advantage
    )
    assert get_adv_estimator_fn(AdvantageEstimator.REMAX) is compute_remax_outcome_advantage


def test_unknown_estimator_lists_known_ones():
    with pytest.raises(ValueError, match=r"'nope'.*gae.*grpo.*reinforce_plus_plus.*rloo"):
        get_adv_estimator_fn("nope")


def test_register_custom_estimator_and_refuse_silent_replacement():
    @register_adv_est("test_constant")
    def constant(token_level_rewards, response_mask):
        return response_mask.float(), response_mask.float()

    try:
        assert get_adv_estimator_fn("test_constant") is constant
        register_adv_est("test_constant")(constant)  # same function again is fine
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est("test_constant")(lambda token_level_rewards, response_mask: None)
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est("gae")(constant)
        out, _ = compute_advantage(
            "test_constant", torch.zeros(2, 3), torch.ones(2, 3), index=np.array([1, 2])
        )
        assert out.tolist() == [[1.0] * 3] * 2
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("test_constant", None)


def test_compute_advantage_dispatches_by_signature():
    mask = torch.ones(6, 2)
    via_dispatch, _ = compute_advantage("grpo", _rewards(), mask, index=INDEX, norm_adv_by_std_in_grpo=False)
    direct, _ = compute_grpo_outcome_advantage(_rewards(), mask, INDEX, norm_adv_by_std_in_grpo=False)
    assert torch.equal(via_dispatch, direct)
    values = torch.zeros(6, 2, dtype=F64)
    gae, _ = compute_advantage("gae", _rewards(), mask, values=values, gamma=0.9, lam=0.8, index=INDEX)
    assert torch.equal(gae, compute_gae_advantage_return(_rewards(), values, mask, 0.9, 0.8)[0])
    with pytest.raises(ValueError, match="needs 'values'"):
        compute_advantage("gae", _rewards(), mask)
    with pytest.raises(ValueError, match="needs 'index'"):
        compute_advantage("rloo", _rewards(), mask)
