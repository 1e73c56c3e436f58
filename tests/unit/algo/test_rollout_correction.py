import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.algo import (
    compute_offpolicy_metrics,
    compute_rollout_correction,
    compute_rollout_correction_weights,
)

F64 = torch.float64

# log(pi_old / pi_rollout): row 0 -> ratios 3, 0.5, 1; row 1 -> 1.5, 1.2 and a padded junk token.
LOG_RATIO = torch.tensor([[math.log(3), math.log(0.5), 0.0], [math.log(1.5), math.log(1.2), 40.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_level_weights_by_hand():
    weights, metrics = compute_rollout_correction_weights(LOG_RATIO, MASK, "token", 2.0)
    assert weights.tolist() == [pytest.approx([2.0, 0.5, 1.0]), pytest.approx([1.5, 1.2, 0.0])]
    assert not weights.requires_grad
    # statistics before truncation: valid ratios 3, 0.5, 1, 1.5, 1.2
    assert metrics["rollout_is_mean"] == pytest.approx(7.2 / 5)
    assert metrics["rollout_is_max"] == pytest.approx(3.0)
    assert metrics["rollout_is_min"] == pytest.approx(0.5)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # 3 > 2
    assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(0.0)  # none < 1/2
    # per-sequence means (4.5 / 3, 2.7 / 2)
    assert metrics["rollout_is_seq_mean"] == pytest.approx((1.5 + 1.35) / 2)
    # std and ESS on weights clamped to [1/2, 2]: 2, 0.5, 1, 1.5, 1.2 -> mean 1.24,
    # mean of squares 8.94 / 5 = 1.788, variance 1.788 - 1.24^2 = 0.2504
    assert metrics["rollout_is_std"] == pytest.approx(math.sqrt(0.2504))
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx(1.24**2 / 1.788)


def test_sequence_level_weights_by_hand():
    # row 0: 3 * 0.5 * 1 = 1.5; row 1: 1.5 * 1.2 = 1.8 (padding excluded from the product)
    weights, metrics = compute_rollout_correction_weights(LOG_RATIO, MASK, "sequence", 2.0)
    assert weights.tolist() == [pytest.approx([1.5, 1.5, 1.5]), pytest.approx([1.8, 1.8, 0.0])]
    assert metrics["rollout_is_max"] == pytest.approx(1.8)
    assert metrics["rollout_is_min"] == pytest.approx(1.5)
    truncated, metrics = compute_rollout_correction_weights(LOG_RATIO, MASK, "sequence", 1.6)
    assert truncated.tolist() == [pytest.approx([1.5, 1.5, 1.5]), pytest.approx([1.6, 1.6, 0.0])]
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)


def test_batch_normalised_weights_have_mean_one():
    # truncated token weights 2, 0.5, 1, 1.5, 1.2 -> mean 1.24
    weights, metrics = compute_rollout_correction_weights(LOG_RATIO, MASK, "token", 2.0, True)
    assert metrics["rollout_is_batch_norm_factor"] == pytest.approx(1.24)
    assert weights[0].tolist() == pytest.approx([2.0 / 1.24, 0.5 / 1.24, 1.0 / 1.24])


def test_rollout_correction_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"'geometric'.*None.*token.*sequence"):
        compute_rollout_correction_weights(LOG_RATIO, MASK, "geometric")
    with pytest.raises(ValueError, match="positive"):
        compute_rollout_correction_weights(LOG_RATIO, MASK, "token", 0.0)
    with pytest.raises(ValueError, match="one shape"):
        compute_rollout_correction(LOG_RATIO, LOG_RATIO[:, :2], MASK, "token")
    with pytest.raises(ValueError, match="at least one valid token"):
        compute_offpolicy_metrics(LOG_RATIO, LOG_RATIO, torch.zeros_like(MASK))


def test_offpolicy_metrics_by_hand():
    old = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=F64)
    rollout = torch.tensor([[math.log(0.25), math.log(0.25)]], dtype=F64)
    m = compute_offpolicy_metrics(old, rollout, torch.ones(1, 2))
    ln2 = math.log(2)
    assert m["logprob_abs_diff_mean"] == pytest.approx(ln2 / 2)
    assert m["logprob_abs_diff_max"] == pytest.approx(ln2)
    assert m["prob_abs_diff_mean"] == pytest.approx(0.125)
    assert m["prob_abs_diff_max"] == pytest.approx(0.25)
    assert m["kl"] == pytest.approx(-ln2 / 2)
    assert m["k3_kl"] == pytest.approx((2 - ln2 - 1) / 2)
    assert m["training_ppl"] == pytest.approx(math.sqrt(8))  # exp(-(ln .5 + ln .25) / 2)
    assert m["rollout_ppl"] == pytest.approx(4.0)
    assert m["log_ppl_diff"] == pytest.approx(-ln2 / 2)
    assert m["ppl_ratio"] == pytest.approx(math.sqrt(8) / 4)
    assert m["chi2_token"] == pytest.approx((4 + 1) / 2 - 1)
    assert m["chi2_seq"] == pytest.approx(2**2 - 1)


def test_compute_rollout_correction_prefixes_metrics():
    old = torch.tensor([[-1.0, -2.0]], dtype=F64)
    rollout = torch.tensor([[-1.1, -1.9]], dtype=F64)
    weights, metrics = compute_rollout_correction(old, rollout, torch.ones(1, 2))
    assert weights is None
    assert "rollout_corr/kl" in metrics
    assert "rollout_corr/rollout_is_mean" not in metrics
    weights, metrics = compute_rollout_correction(old, rollout, torch.ones(1, 2), rollout_is="token")
    assert weights.tolist() == [pytest.approx([math.exp(0.1), math.exp(-0.1)])]
    assert all(key.startswith("rollout_corr/") for key in metrics)
    assert "rollout_corr/rollout_is_mean" in metrics


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    level=st.sampled_from(["token", "sequence"]),
    threshold=st.floats(1.01, 10.0),
    junk=st.sampled_from([float("nan"), 1e4, -1e4]),
)
def test_weights_are_truncated_and_ignore_masked_positions(seed, level, threshold, junk):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 6, generator=gen, dtype=F64) * 3
    rollout = old + torch.randn(3, 6, generator=gen, dtype=F64) * 0.7
    mask = (torch.rand(3, 6, generator=gen) > 0.3).long()
    mask[0, 0] = 1
    valid = mask.bool()
    clean, _ = compute_rollout_correction(old, rollout, mask, level, threshold)
    dirty_old = torch.where(valid, old, torch.full_like(old, junk))
    dirty, dirty_metrics = compute_rollout_correction(dirty_old, rollout, mask, level, threshold)
    assert torch.equal(clean, dirty)
    assert bool((clean <= threshold).all())
    assert bool((clean[~valid] == 0).all())
    assert all(math.isfinite(v) for v in dirty_metrics.values())
