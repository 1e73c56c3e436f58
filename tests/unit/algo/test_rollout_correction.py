import math
import statistics

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
EPS = 1e-8
# std = sqrt(E[w^2] - mean^2): for near-equal weights the difference cancels to rounding noise (~1e-14),
# whose square root is ~1e-7 in either implementation.
STD_ABS = 1e-6

# log(pi_old / pi_rollout): row 0 -> ratios 3, 0.5, 1; row 1 -> 1.5, 1.2 and a padded junk token.
LOG_RATIO = torch.tensor([[math.log(3), math.log(0.5), 0.0], [math.log(1.5), math.log(1.2), 40.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_level_weights_by_hand():
    weights, metrics = compute_rollout_correction_weights(LOG_RATIO, MASK, "token", 2.0)
    assert weights.tolist() == [pytest.approx([2.0, 0.5, 1.0]), pytest.approx([1.5, 1.2, 0.0])]
    assert not weights.requires_grad
    # statistics of the truncated weights 2, 0.5, 1, 1.5, 1.2 (the raw ratio 3 counts as "high")
    assert metrics["rollout_is_mean"] == pytest.approx(6.2 / 5)
    assert metrics["rollout_is_max"] == pytest.approx(2.0)
    assert metrics["rollout_is_min"] == pytest.approx(0.5)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # 3 > 2
    assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(0.0)  # none < 1/2
    # per-sequence means of truncated weights 3.5 / 3 and 2.7 / 2
    assert metrics["rollout_is_seq_mean"] == pytest.approx((3.5 / 3 + 1.35) / 2)
    assert metrics["rollout_is_seq_max"] == pytest.approx(1.35)
    # mean 1.24, mean of squares 8.94 / 5 = 1.788, variance 1.788 - 1.24^2 = 0.2504
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
    assert metrics["rollout_is_max"] == pytest.approx(1.8)  # from the log-ratio sums, untruncated
    assert metrics["rollout_is_mean"] == pytest.approx((3 * 1.5 + 2 * 1.6) / 5)
    assert metrics["rollout_is_seq_max"] == pytest.approx(1.6)
    assert metrics["rollout_is_seq_fraction_high"] == pytest.approx(1 / 2)  # raw mean 1.8 > 1.6


def verl_is_metrics(
    log_ratio: list[list[float]], mask: list[list[int]], level: str, c: float
) -> dict[str, float]:
    """verl 0.9.1 ``compute_is_metrics`` of ``compute_rollout_correction_weights``' TIS weights, in loops.
    Its masked means divide by the count + 1e-8 (``verl_F.masked_mean``); so do these."""
    bs, length = len(log_ratio), len(log_ratio[0])
    rows, cols = range(bs), range(length)
    valid = [[bool(mask[i][t]) for t in cols] for i in rows]
    sums = [sum(log_ratio[i][t] for t in cols if valid[i][t]) for i in rows]
    raw = [[0.0] * length for _ in rows]
    for i in rows:
        for t in cols:
            if valid[i][t]:
                exponent = log_ratio[i][t] if level == "token" else sums[i]
                raw[i][t] = math.exp(min(max(exponent, -20.0), 20.0))
    w = [[min(x, c) for x in row] for row in raw]
    w_valid = [w[i][t] for i in rows for t in cols if valid[i][t]]
    raw_valid = [raw[i][t] for i in rows for t in cols if valid[i][t]]
    n = len(w_valid) + EPS
    mean = sum(w_valid) / n
    m = {"rollout_is_mean": mean}
    if level == "token":
        m["rollout_is_max"], m["rollout_is_min"] = max(w_valid), min(w_valid)
        m["rollout_is_ratio_fraction_high"] = sum(x > c for x in raw_valid) / n
        m["rollout_is_ratio_fraction_low"] = sum(x < 1 / c for x in raw_valid) / n
    else:  # every row's sum, rows without a valid token included (their sum is 0)
        m["rollout_is_max"], m["rollout_is_min"] = math.exp(min(max(sums), 20.0)), math.exp(min(sums))
        m["rollout_is_ratio_fraction_high"] = sum(s > math.log(c) for s in sums) / len(sums)
        m["rollout_is_ratio_fraction_low"] = sum(s < math.log(1 / c) for s in sums) / len(sums)
    m["rollout_is_std"] = math.sqrt(max(sum(x * x for x in w_valid) / n - mean**2, 0.0)) if n > 1 else 0.0
    m["rollout_is_eff_sample_size"] = 1 / (sum((x / (mean + EPS)) ** 2 for x in w_valid) / n)

    def row_mean(values: list[list[float]], i: int) -> float:
        kept = [values[i][t] for t in cols if valid[i][t]]
        return sum(kept) / (len(kept) + EPS)

    seq = [row_mean(w, i) for i in rows]
    raw_seq = [row_mean(raw, i) for i in rows]
    m["rollout_is_seq_mean"] = statistics.fmean(seq)
    m["rollout_is_seq_std"] = statistics.stdev(seq) if len(seq) > 1 else 0.0
    m["rollout_is_seq_max"], m["rollout_is_seq_min"] = max(seq), min(seq)
    m["rollout_is_seq_max_deviation"] = max(abs(x - 1) for x in seq)
    m["rollout_is_seq_fraction_high"] = sum(x > c for x in raw_seq) / len(seq)
    m["rollout_is_seq_fraction_low"] = sum(x < 1 / c for x in raw_seq) / len(seq)
    return m


# Truncation binds (ratios 5, 3, exp(1.2)) and log-ratios pass the exp(+-20) clamp (25, -30): the raw
# weights reach exp(20), the truncated ones never pass 2. Row 3 has no valid token.
EXTREME_LOG_RATIO = [
    [25.0, math.log(5.0), 0.1, 7.0],
    [math.log(0.2), -30.0, math.log(3.0), 0.0],
    [0.3, -0.2, 1.2, 0.05],
    [9.0, 9.0, 9.0, 9.0],
]
EXTREME_MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_metrics_are_verls_on_truncated_weights(level):
    threshold = 2.0
    _, metrics = compute_rollout_correction_weights(
        torch.tensor(EXTREME_LOG_RATIO, dtype=F64), torch.tensor(EXTREME_MASK), level, threshold
    )
    expected = verl_is_metrics(EXTREME_LOG_RATIO, EXTREME_MASK, level, threshold)
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        tolerance = STD_ABS if key == "rollout_is_std" else 1e-12
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=tolerance), key
    for key in ("rollout_is_mean", "rollout_is_seq_mean", "rollout_is_seq_max"):
        assert metrics[key] <= threshold, key  # statistics of weights the loss can actually see
    if level == "token":
        assert metrics["rollout_is_max"] == threshold
    else:
        assert metrics["rollout_is_max"] == pytest.approx(math.exp(20.0))  # the clamp, not the threshold


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    level=st.sampled_from(["token", "sequence"]),
    threshold=st.floats(1.01, 10.0),
    scale=st.sampled_from([0.3, 3.0, 30.0]),
)
def test_is_metrics_match_verls_definition(seed, level, threshold, scale):
    gen = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(4, 5, generator=gen, dtype=F64) * scale
    mask = (torch.rand(4, 5, generator=gen) > 0.3).to(F64)  # float: the masked means keep their 1e-8
    mask[0, 0] = 1
    _, metrics = compute_rollout_correction_weights(log_ratio, mask, level, threshold)
    expected = verl_is_metrics(log_ratio.tolist(), mask.tolist(), level, threshold)
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        tolerance = STD_ABS if key == "rollout_is_std" else 1e-12
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=tolerance), key


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
