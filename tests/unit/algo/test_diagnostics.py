import math

import pytest
import torch

import rlmesh.algo
from rlmesh.algo import compute_approx_kl, compute_clipfrac, compute_data_metrics, masked_stats


def test_clipfrac_by_hand():
    # ratios 0.5 (below 0.8), 1.0, 1.25 (inside), 1.35 (above 1.3); masked 10.0
    ratios = torch.tensor([[0.5, 1.0, 1.25, 1.35, 10.0]], dtype=torch.float64)
    old = torch.full_like(ratios, -1.0)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert compute_clipfrac(old + ratios.log(), old, mask, 0.2, 0.3).item() == pytest.approx(0.5)


def test_approx_kl_by_hand():
    old = torch.tensor([[-1.0, -2.0, -9.0]], dtype=torch.float64)
    new = torch.tensor([[-1.5, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    # k1: mean(old - new) = (0.5 - 1) / 2
    assert compute_approx_kl(new, old, mask).item() == pytest.approx(-0.25)
    # k3 with d = old - new: e^{-d} + d - 1 -> (e^{-0.5} - 0.5) and (e^{1} - 2)
    expected = ((math.exp(-0.5) + 0.5 - 1) + (math.exp(1) - 1 - 1)) / 2
    assert compute_approx_kl(new, old, mask, "k3").item() == pytest.approx(expected)


def test_masked_stats_by_hand():
    values = torch.tensor([[1.0, 2.0], [3.0, 99.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert masked_stats(values, mask) == {"mean": 2.0, "max": 3.0, "min": 1.0}
    # nothing valid: verl's NaN, which the sinks drop, not a made-up 0
    assert all(math.isnan(v) for v in masked_stats(values, torch.zeros_like(mask)).values())


def _mean_max_min(xs):
    if not xs:
        return [math.nan] * 3
    return [sum(xs) / len(xs), max(xs), min(xs)]


def _unbiased_var(xs):
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


def verl_data_metrics(scores, rewards, adv, ret, resp_mask, attn, max_p, max_r, values=None):
    """verl 0.9.1's compute_data_metrics, written out with loops over plain lists."""
    width = len(resp_mask[0])
    p_len = [float(sum(row[:-width])) for row in attn]
    r_len = [float(sum(row[-width:])) for row in attn]
    kept = [i for i in range(len(attn)) if r_len[i] > 0]  # aborted: empty response
    tokens = [(i, t) for i in range(len(attn)) for t in range(width) if resp_mask[i][t]]
    columns = {
        "critic/score": [sum(scores[i]) for i in kept],
        "critic/rewards": [sum(rewards[i]) for i in kept],
        "critic/advantages": [adv[i][t] for i, t in tokens],
        "critic/returns": [ret[i][t] for i, t in tokens],
        "response_length": r_len,
        "response_length_non_aborted": [r_len[i] for i in kept],
        "prompt_length": p_len,
    }
    if values is not None:
        columns["critic/values"] = [values[i][t] for i, t in tokens]
    out = {}
    for name, xs in columns.items():
        out.update(zip((f"{name}/mean", f"{name}/max", f"{name}/min"), _mean_max_min(xs), strict=True))
    for name, xs, limit in (
        ("response_length", r_len, max_r),
        ("response_length_non_aborted", [r_len[i] for i in kept], max_r),
        ("prompt_length", p_len, max_p),
    ):
        out[f"{name}/clip_ratio"] = sum(x == limit for x in xs) / len(xs) if xs else math.nan
    out["response/aborted_ratio"] = 1 - len(kept) / len(attn)
    if values is not None:
        rs = [ret[i][t] for i, t in tokens]
        diff = [ret[i][t] - values[i][t] for i, t in tokens]
        out["critic/vf_explained_var"] = 1 - _unbiased_var(diff) / (_unbiased_var(rs) + 1e-5)
    return out


def _call(scores, rewards, adv, ret, resp_mask, attn, max_p, max_r, values=None):
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return compute_data_metrics(
        t(scores), t(rewards), t(adv), t(ret), torch.tensor(resp_mask), torch.tensor(attn), max_p, max_r,
        None if values is None else t(values),
    )  # fmt: skip


# Prompt width 3 (left-padded), response width 4 (right-padded). Row 0: a full prompt and a full
# response (both clipped); row 1: a response whose second token is a tool's (attended, not trained
# on); row 2: an aborted sample (empty response) whose score must not count; row 3: one token.
ATTN = [[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0]]
RESP_MASK = [[1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
# Scores on more than the last token (an overlong penalty, say): a row's score is its whole sum.
SCORES = [[0.0, 0.0, -0.5, 1.0], [0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 9.0], [0.25, 0.0, 0.0, 0.0]]
REWARDS = [[-0.1, 0.0, -0.6, 1.0], [0.0, -0.2, 2.0, 0.0], [0.0, 0.0, 0.0, 9.0], [0.2, 0.0, 0.0, 0.0]]
# Junk where the response mask is 0: it would top max/min if the mask were ignored.
ADV = [[0.5, -0.5, 1.5, 0.0], [2.0, 99.0, -1.0, -99.0], [50.0, 50.0, 50.0, 50.0], [0.25, -50.0, 7.0, 7.0]]
# Returns and values a few thousandths apart: Var(R) is then near verl's 1e-5, so a biased
# variance (divided by n, not n - 1) would move the explained variance visibly.
RET = [[0.001, 0.004, 0.0, 0.006], [0.002, 5.0, 0.005, -5.0], [1.0, 1.0, 1.0, 1.0], [0.003, 3.0, 3.0, 3.0]]
VALUES = [[0.002, 0.003, 0.001, 0.004], [0.0, -4.0, 0.004, 4.0], [0.0, 0.0, 0.0, 0.0], [0.001, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("with_values", [True, False])
def test_data_metrics_are_verls(with_values):
    values = VALUES if with_values else None
    got = _call(SCORES, REWARDS, ADV, RET, RESP_MASK, ATTN, 3, 4, values)
    want = verl_data_metrics(SCORES, REWARDS, ADV, RET, RESP_MASK, ATTN, 3, 4, values)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key  # lengths are float32
    # the mix-ups this batch would show
    assert got["critic/score/mean"] == pytest.approx((0.5 + 2.0 + 0.25) / 3)  # row sums, aborted row out
    assert got["critic/advantages/max"] == 2.0 and got["critic/advantages/min"] == -1.0
    assert got["response_length/mean"] == pytest.approx((4 + 3 + 0 + 1) / 4)  # attention, not loss mask
    assert got["response_length_non_aborted/min"] == 1.0 and got["response/aborted_ratio"] == 0.25
    assert got["response_length/clip_ratio"] == 0.25 and got["prompt_length/clip_ratio"] == 0.25
    if with_values:
        rs = [0.001, 0.004, 0.0, 0.006, 0.002, 0.005, 0.003]
        biased = lambda xs: _unbiased_var(xs) * (len(xs) - 1) / len(xs)  # noqa: E731
        diff = [r - v for r, v in zip(rs, [0.002, 0.003, 0.001, 0.004, 0.0, 0.004, 0.001], strict=True)]
        wrong = 1 - biased(diff) / (biased(rs) + 1e-5)
        assert got["critic/vf_explained_var"] != pytest.approx(wrong, rel=1e-3)


def test_data_metrics_of_nothing_valid_are_nan_as_in_verl():
    attn = [[1, 1, 0, 0], [1, 1, 0, 0]]  # two prompts, both responses aborted
    zeros = [[0.0, 0.0], [0.0, 0.0]]
    got = _call(zeros, zeros, zeros, zeros, [[0, 0], [0, 0]], attn, 2, 2, zeros)
    want = verl_data_metrics(zeros, zeros, zeros, zeros, [[0, 0], [0, 0]], attn, 2, 2)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, nan_ok=True), key
    assert math.isnan(got["critic/score/mean"]) and math.isnan(got["critic/advantages/max"])
    assert math.isnan(got["critic/vf_explained_var"]) and got["response/aborted_ratio"] == 1.0
    assert got["response_length/mean"] == 0.0 and got["prompt_length/clip_ratio"] == 1.0
    # one valid token: torch.var (unbiased) of one element is NaN in verl
    one = _call([[1.0]], [[1.0]], [[1.0]], [[1.0]], [[1]], [[1, 1]], 1, 1, [[0.5]])
    assert math.isnan(one["critic/vf_explained_var"]) and one["critic/values/mean"] == 0.5


def test_every_public_name_is_exported():
    for name in rlmesh.algo.__all__:
        assert getattr(rlmesh.algo, name) is not None, name
