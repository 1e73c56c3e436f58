import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.algo import (
    LOSS_AGG_MODES,
    POLICY_LOSS_REGISTRY,
    agg_loss,
    compute_entropy_loss,
    compute_pg_losses,
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_vanilla,
    compute_value_loss,
    get_policy_loss_fn,
    policy_loss_info,
    register_policy_loss,
)
from rlmesh.config.actor_rollout_ref import PolicyLossMode

F64 = torch.float64

# ---------------------------------------------------------------- agg_loss
# Formulas of verl v0.9.0's agg_loss (verl/trainer/ppo/core_algos.py); see agg_loss's docstring.

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
# valid: row 0 -> 1, 2 (sum 3, mean 1.5); row 1 -> 4 (sum 4, mean 4); row 2 fully masked.
# N = 3 tokens, B = 2 sequences with a valid token, T = 3.


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / N=3
        ("token-sum", 7.0),  # 1 + 2 + 4
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / B=2 sequences with a valid token
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / B=2
        ("seq-mean-token-sum-norm", 7 / 6),  # (3 + 4) / B=2 / T=3
    ],
)
def test_agg_loss_by_hand(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_modes_are_verls():
    assert LOSS_AGG_MODES == (
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    )


def test_seq_mean_token_sum_norm_counts_only_non_empty_sequences():
    # 5 sequences of width T=4, two of them empty (rows 1 and 3):
    #   row 0: 0.5 + 1.5 = 2;  row 2: 3 + 1 + 2 + 6 = 12;  row 4: -2.
    loss = torch.tensor(
        [
            [0.5, 1.5, 9.0, 9.0],
            [9.0, 9.0, 9.0, 9.0],
            [3.0, 1.0, 2.0, 6.0],
            [9.0, 9.0, 9.0, 9.0],
            [-2.0, 9.0, 9.0, 9.0],
        ],
        dtype=F64,
    )
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    # (2 + 12 - 2) / B=3 non-empty sequences / T=4 = 1 (not / 4 alone = 3, nor / 5 rows / 4 = 0.6)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(1.0)
    # a constant C = 8 instead of the padded width
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=8).item() == pytest.approx(0.5)
    # it is seq-mean-token-sum / C
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(4.0)
    # global batch: 6 non-empty sequences on 2 ranks, C = 8: 12 / 6 * 2 / 8
    got = agg_loss(loss, mask, "seq-mean-token-sum-norm", dp_size=2, global_batch_size=6, loss_scale_factor=8)
    assert got.item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        # micro-batch share of a global batch, times dp_size: sum / global count * dp_size
        ("token-mean", {"dp_size": 4, "batch_num_tokens": 6}, 7 / 6 * 4),
        ("token-sum", {"dp_size": 3}, 7 * 3),
        ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 8}, 7 / 8 * 2),
        ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 8}, 5.5 / 8 * 2),
        (
            "seq-mean-token-sum-norm",
            {"dp_size": 2, "global_batch_size": 8, "loss_scale_factor": 10},
            7 / 8 * 2 / 10,
        ),
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 7}, 7 / 2 / 7),
        # counts given as tensors (as after an all-reduce)
        ("token-mean", {"dp_size": 2, "batch_num_tokens": torch.tensor(14)}, 7 / 14 * 2),
        ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": torch.tensor(7.0)}, 2.0),
    ],
)
def test_agg_loss_global_batch_arguments(mode, kwargs, expected):
    assert agg_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("mode", "missing"),
    [
        ("token-mean", "batch_num_tokens"),
        ("seq-mean-token-sum", "global_batch_size"),
        ("seq-mean-token-mean", "global_batch_size"),
        ("seq-mean-token-sum-norm", "global_batch_size"),
    ],
)
def test_agg_loss_with_dp_size_needs_the_global_count(mode, missing):
    with pytest.raises(ValueError, match=missing):
        agg_loss(LOSS, MASK, mode, dp_size=2)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), dp=st.integers(1, 3), micro=st.integers(1, 3))
def test_agg_loss_of_micro_batches_sums_to_the_global_batch_loss(seed, dp, micro):
    """With the global counts, the micro-batch losses of every rank, summed and divided by dp_size
    (the data-parallel gradient average), give the loss of the whole batch in one piece."""
    g = torch.Generator().manual_seed(seed)
    rows, width = dp * micro * 2, 6
    loss = torch.randn(rows, width, generator=g, dtype=F64)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)  # some sequences may be empty
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    n_tokens, n_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    for mode in LOSS_AGG_MODES:
        whole = agg_loss(loss, mask, mode, loss_scale_factor=width)
        parts = sum(
            agg_loss(
                loss[i : i + 2],
                mask[i : i + 2],
                mode,
                dp_size=dp,
                batch_num_tokens=n_tokens,
                global_batch_size=n_seqs,
                loss_scale_factor=width,
            )
            for i in range(0, rows, 2)
        )
        torch.testing.assert_close(parts / dp, whole, msg=mode)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_of_fully_masked_batch_is_zero(mode):
    assert agg_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


def test_agg_loss_unknown_mode_names_allowed_values():
    with pytest.raises(ValueError, match=r"'token-max'.*token-mean.*token-sum.*seq-mean-token-sum-norm"):
        agg_loss(LOSS, MASK, "token-max")


def test_losses_pass_the_global_batch_arguments_to_agg_loss():
    kw = {"dp_size": 2, "batch_num_tokens": 10, "global_batch_size": 4, "loss_scale_factor": 5}
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(3, 3, generator=g, dtype=F64) for _ in range(3))
    for mode in LOSS_AGG_MODES:
        pg_loss = compute_policy_loss(a, b, c, MASK, cliprange=0.2, loss_agg_mode=mode, **kw)[0]
        terms = compute_pg_losses(a, b, c, 0.2, 0.2)
        torch.testing.assert_close(pg_loss, agg_loss(terms["pg_losses"], MASK, mode, **kw))
        vf_loss, _ = compute_value_loss(a, b, c, MASK, 0.2, loss_agg_mode=mode, **kw)
        clipped = torch.max((a - b) ** 2, (c + (a - c).clamp(-0.2, 0.2) - b) ** 2)
        torch.testing.assert_close(vf_loss, 0.5 * agg_loss(clipped, MASK, mode, **kw))
        logits = torch.randn(3, 3, 5, generator=g, dtype=F64)
        entropy = compute_entropy_loss(logits, MASK, loss_agg_mode=mode, **kw)
        h = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
        torch.testing.assert_close(entropy, agg_loss(h, MASK, mode, **kw))


# ---------------------------------------------------------------- policy loss

# One row, cliprange_low 0.2, cliprange_high 0.3, clip_ratio_c 3:
#   tok  A    ratio  -A*r   -A*clip(r,0.8,1.3)  max    dual(A<0): min(-A*3, max)  clipped  lower
#   1    1    1.5   -1.5   -1.3                -1.3   -                          yes      no
#   2    1    0.5   -0.5   -0.8                -0.5   -                          no       no
#   3   -1    0.5    0.5    0.8                 0.8   min(3, 0.8) = 0.8          yes      no
#   4   -1    5.0    5.0    1.3                 5.0   min(3, 5) = 3              no       yes
#   5   -2    1.1    2.2    2.2                 2.2   min(6, 2.2) = 2.2          no       no
#   6  100   e^10   (masked)
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0, 100.0]], dtype=F64)
RATIO = torch.tensor([[1.5, 0.5, 0.5, 5.0, 1.1, math.exp(10)]], dtype=F64)
OLD = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5, -20.0]], dtype=F64)
NEW = OLD + RATIO.log()
PG_MASK = torch.tensor([[1, 1, 1, 1, 1, 0]])


def test_pg_losses_per_token_by_hand():
    terms = compute_pg_losses(OLD, NEW, ADV, 0.2, 0.3, 3.0)
    assert terms["pg_losses"][0, :5].tolist() == pytest.approx([-1.3, -0.5, 0.8, 3.0, 2.2])
    assert terms["is_clipped"][0, :5].tolist() == [True, False, True, False, False]
    assert terms["is_clipped_lower"][0, :5].tolist() == [False, False, False, True, False]


def test_policy_loss_by_hand():
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        OLD, NEW, ADV, PG_MASK, cliprange_low=0.2, cliprange_high=0.3, clip_ratio_c=3.0
    )
    assert pg_loss.item() == pytest.approx((-1.3 - 0.5 + 0.8 + 3.0 + 2.2) / 5)
    assert clipfrac.item() == pytest.approx(2 / 5)
    assert clipfrac_lower.item() == pytest.approx(1 / 5)
    assert ppo_kl.item() == pytest.approx(-math.log(1.5 * 0.5 * 0.5 * 5.0 * 1.1) / 5)


def test_policy_loss_symmetric_cliprange():
    # cliprange 0.2 clips token 1 at 1.2 instead of 1.3.
    pg_loss, *_ = compute_policy_loss(OLD, NEW, ADV, PG_MASK, cliprange=0.2)
    assert pg_loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 3.0 + 2.2) / 5)


def test_policy_loss_with_rollout_is_weights():
    weights = torch.tensor([[2.0, 1.0, 0.5, 1.0, 1.0, 7.0]], dtype=F64)
    pg_loss, *_ = compute_policy_loss(
        OLD, NEW, ADV, PG_MASK, cliprange_low=0.2, cliprange_high=0.3, rollout_is_weights=weights
    )
    assert pg_loss.item() == pytest.approx((-2.6 - 0.5 + 0.4 + 3.0 + 2.2) / 5)


def test_policy_loss_clamps_log_ratio_at_20():
    old = torch.tensor([[0.0]], dtype=F64)
    new = torch.tensor([[50.0]], dtype=F64)
    adv = torch.tensor([[-1.0]], dtype=F64)
    _, _, ppo_kl, _ = compute_policy_loss(old, new, adv, torch.ones(1, 1), cliprange=0.2, clip_ratio_c=1e12)
    assert ppo_kl.item() == -20.0
    pg_loss, *_ = compute_policy_loss(old, new, adv, torch.ones(1, 1), cliprange=0.2, clip_ratio_c=1e12)
    assert pg_loss.item() == pytest.approx(math.exp(20))


def test_policy_loss_rejects_bad_arguments():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(OLD, NEW, ADV, PG_MASK, cliprange=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="cliprange"):
        compute_policy_loss(OLD, NEW, ADV, PG_MASK)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_policy_loss(OLD, NEW, ADV, PG_MASK, cliprange=0.2, loss_agg_mode="bogus")


def test_policy_loss_registry():
    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla
    assert get_policy_loss_fn("gspo") is compute_policy_loss_gspo
    with pytest.raises(ValueError, match=r"'bypass_mode'.*'cispo'.*'vanilla'"):
        get_policy_loss_fn("bypass_mode")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a: None)
    # verl 0.9.1's registry but bypass_mode (the config sends that to rollout_correction.bypass_mode),
    # and exactly the names the config accepts.
    assert set(POLICY_LOSS_REGISTRY) == {
        "vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro",
    }  # fmt: skip
    assert set(POLICY_LOSS_REGISTRY) == set(typing.get_args(PolicyLossMode))


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    clip_low=st.floats(0.01, 0.9),
    clip_high=st.floats(0.01, 2.0),
    clip_ratio_c=st.floats(1.01, 10.0),
    spread=st.floats(0.0, 25.0),
)
def test_dual_clip_bounds_every_negative_advantage(seed, clip_low, clip_high, clip_ratio_c, spread):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 16, generator=gen, dtype=F64) * 5
    new = old + torch.randn(4, 16, generator=gen, dtype=F64) * spread
    adv = torch.randn(4, 16, generator=gen, dtype=F64) * 3
    losses = compute_pg_losses(old, new, adv, clip_low, clip_high, clip_ratio_c)["pg_losses"]
    negative = adv < 0
    bound = -adv * clip_ratio_c
    assert bool((losses[negative] <= bound[negative] * (1 + 1e-12)).all())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), junk=st.sampled_from([float("nan"), 1e6, -50.0]))
def test_masked_positions_never_change_the_losses(seed, junk):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 7, generator=gen, dtype=F64) * 4
    new = old + torch.randn(3, 7, generator=gen, dtype=F64) * 0.5
    adv = torch.randn(3, 7, generator=gen, dtype=F64)
    mask = (torch.rand(3, 7, generator=gen) > 0.4).long()
    mask[0, 0] = 1
    junkify = lambda x: torch.where(mask.bool(), x, torch.full_like(x, junk))  # noqa: E731
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        clean = compute_policy_loss(old, new, adv, mask, cliprange=0.2, loss_agg_mode=mode)
        dirty = compute_policy_loss(
            junkify(old), junkify(new), junkify(adv), mask, cliprange=0.2, loss_agg_mode=mode
        )
        for a, b in zip(clean, dirty, strict=True):
            assert torch.equal(a, b)
        clean_v = compute_value_loss(new, adv, old, mask, 0.2, mode)
        dirty_v = compute_value_loss(junkify(new), junkify(adv), junkify(old), mask, 0.2, mode)
        for a, b in zip(clean_v, dirty_v, strict=True):
            assert torch.equal(a, b)


def test_policy_loss_gradcheck_at_smooth_points():
    # Ratios away from 1 +- clip and dual-clip kinks, advantages away from 0.
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.2, -0.7, -2.2, -1.0]], dtype=F64)
    ratio = torch.tensor([[1.05, 1.6, 0.5, 1.1], [0.9, 4.0, 1.02, 0.6]], dtype=F64)
    adv = torch.tensor([[0.7, 1.3, -0.4, -1.1], [-0.9, -0.5, 2.0, 1.5]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    new = (old + ratio.log()).requires_grad_()
    for mode in ("token-mean", "seq-mean-token-mean"):
        assert torch.autograd.gradcheck(
            lambda lp, mode=mode: compute_policy_loss(old, lp, adv, mask, cliprange=0.2, loss_agg_mode=mode)[
                0
            ],
            (new,),
        )


# ---------------------------------------------------------------- policy loss modes
# Each mode against a plain, per-token re-implementation of verl 0.9.1's definition
# (verl/trainer/ppo/core_algos.py, compute_policy_loss_<mode>): per-token losses and metrics from
# python floats, aggregated by the loop below, compared with the registered function.

EPS = 1e-8


def ref_agg(losses, mask, mode):
    """verl's agg_loss over one batch, as loops (agg_loss's table)."""
    rows = [[x for x, m in zip(lr, mr, strict=True) if m] for lr, mr in zip(losses, mask, strict=True)]
    non_empty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    if mode == "token-sum":
        return sum(map(sum, rows))
    if mode == "seq-mean-token-sum":
        return sum(map(sum, non_empty)) / len(non_empty)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / (len(r) + EPS) for r in non_empty) / len(non_empty)
    if mode == "seq-mean-token-sum-norm":
        return sum(map(sum, non_empty)) / len(non_empty) / len(mask[0])
    raise AssertionError(mode)


def ref_masked_mean(values, mask):
    total = sum(v for vr, mr in zip(values, mask, strict=True) for v, m in zip(vr, mr, strict=True) if m)
    return total / (sum(map(sum, mask)) + EPS)


def clamp(x, lo=-math.inf, hi=math.inf):
    return min(max(x, lo), hi)


def cells(case):
    """(i, t, old, new, adv, weight) of every position, row-major."""
    for i in range(len(case.mask)):
        for t in range(len(case.mask[0])):
            yield i, t, case.old[i][t], case.new[i][t], case.adv[i][t], case.w[i][t]


def per_token(case, fn):
    """A (bs, T) list of lists of ``fn(i, t, old, new, adv, weight)``."""
    out = [[0.0] * len(case.mask[0]) for _ in case.mask]
    for i, t, o, n, a, w in cells(case):
        out[i][t] = fn(i, t, o, n, a, w)
    return out


class Case:
    """Random old/new log-probs (probabilities, so DPPO's are meaningful), advantages, rollout IS
    weights (1 when absent), a mask with sequences of different lengths and one empty row."""

    def __init__(self, seed, weighted, empty_row=True, bs=5, width=7):
        g = torch.Generator().manual_seed(seed)
        self.t_old = -torch.rand(bs, width, generator=g, dtype=F64) * 3 - 0.05
        self.t_new = (self.t_old + torch.randn(bs, width, generator=g, dtype=F64) * 0.3).clamp(max=-1e-3)
        self.t_adv = torch.randn(bs, width, generator=g, dtype=F64)
        lengths = torch.randint(1, width + 1, (bs,), generator=g)
        if empty_row:
            lengths[2] = 0
        self.t_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        self.t_w = torch.rand(bs, width, generator=g, dtype=F64) * 2 if weighted else None
        self.old, self.new, self.adv, self.mask = (
            x.tolist() for x in (self.t_old, self.t_new, self.t_adv, self.t_mask)
        )
        self.w = self.t_w.tolist() if weighted else [[1.0] * width for _ in range(bs)]

    def run(self, fn, mode, **knobs):
        return fn(
            self.t_old,
            self.t_new,
            self.t_adv,
            self.t_mask,
            loss_agg_mode=mode,
            rollout_is_weights=self.t_w,
            **knobs,
        )


LOW, HIGH, CLIP_C = 0.15, 0.25, 1.2  # CLIP_C: DPPO's IS truncation


def ref_gspo(case, mode):
    s = []  # the sequence ratios (the value of every s_{i,t} of the row)
    for o_row, n_row, m_row in zip(case.old, case.new, case.mask, strict=True):
        n = max(sum(m_row), 1)
        s.append(
            math.exp(min(sum((b - a) * m for a, b, m in zip(o_row, n_row, m_row, strict=True)) / n, 10.0))
        )

    def terms(i, t, o, n, a, w):
        pg1, pg2 = -a * s[i], -a * clamp(s[i], 1 - LOW, 1 + HIGH)
        return max(pg1, pg2) * w, float(pg2 > pg1)

    tok = per_token(case, terms)
    metrics = {
        "actor/pg_clipfrac": ref_masked_mean([[c for _, c in r] for r in tok], case.mask),
        "actor/ppo_kl": ref_masked_mean(per_token(case, lambda i, t, o, n, a, w: o - n), case.mask),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return ref_agg([[x for x, _ in r] for r in tok], case.mask, mode), metrics


def ref_sapo(case, mode):
    tau_pos, tau_neg = 1.0, 1.05

    def loss(i, t, o, n, a, w):
        tau = tau_pos if a > 0 else tau_neg
        r = math.exp(clamp(n - o, -20, 20))
        return -(1 / (1 + math.exp(-tau * (r - 1)))) * (4 / tau) * a * w

    metrics = {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": ref_masked_mean(per_token(case, lambda i, t, o, n, a, w: o - n), case.mask),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return ref_agg(per_token(case, loss), case.mask, "seq-mean-token-mean"), metrics  # always


def ref_gpg(case, mode):
    return ref_agg(per_token(case, lambda i, t, o, n, a, w: -n * a * w), case.mask, mode), {}


def ref_cispo(case, mode):
    def terms(i, t, o, n, a, w):
        r = math.exp(clamp(n - o, -20, 20))
        c = clamp(r, 1 - LOW, 1 + HIGH)
        return -c * a * n * w, float(r != c)

    tok = per_token(case, terms)
    metrics = {
        "actor/pg_clipfrac": ref_masked_mean([[c for _, c in r] for r in tok], case.mask),
        "actor/ppo_kl": ref_masked_mean(per_token(case, lambda i, t, o, n, a, w: o - n), case.mask),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return ref_agg([[x for x, _ in r] for r in tok], case.mask, mode), metrics


def ref_geo_mean(case, mode):
    """verl's: the mean over the rows (no row of these cases is empty)."""
    seq_losses, clip_hi, clip_lo = [], [], []
    for o_row, n_row, a_row, w_row, m_row in zip(
        case.old, case.new, case.adv, case.w, case.mask, strict=True
    ):
        n = sum(m_row)
        log_ratio = adv = log_w = 0.0
        for o, nw, a, w, m in zip(o_row, n_row, a_row, w_row, m_row, strict=True):
            if m:
                lr = nw - o
                sgn = (a > 0) - (a < 0)
                log_ratio += sgn * min(sgn * lr, sgn * clamp(lr, -LOW, HIGH))
                adv += a
                log_w += math.log(w + 1e-10)
        seq_losses.append(-adv / (n + EPS) * math.exp(log_ratio / (n + EPS)) * math.exp(log_w / (n + EPS)))
    clipped = per_token(case, lambda i, t, o, n, a, w: clamp(n - o, -LOW, HIGH) != n - o)
    clip_hi = per_token(case, lambda i, t, o, n, a, w: float(clipped[i][t] and a > 0))
    clip_lo = per_token(case, lambda i, t, o, n, a, w: float(clipped[i][t] and a < 0))
    metrics = {
        "actor/pg_clipfrac": ref_masked_mean(clip_hi, case.mask),
        "actor/ppo_kl": ref_masked_mean(per_token(case, lambda i, t, o, n, a, w: o - n), case.mask),
        "actor/pg_clipfrac_lower": ref_masked_mean(clip_lo, case.mask),
    }
    return sum(seq_losses) / len(seq_losses), metrics


COV_RATIO, COV_LB, COV_UB, COV_SEED = 0.15, 0.01, 3.0, 11


def ref_clip_cov(case, mode):
    valid = [(i, t) for i, t, *_ in cells(case) if case.mask[i][t]]
    mean_a = sum(case.adv[i][t] for i, t in valid) / (len(valid) + EPS)
    mean_lp = sum(case.new[i][t] for i, t in valid) / (len(valid) + EPS)
    candidates = []  # row-major, as torch.nonzero
    for i, t in valid:
        o, n, a = case.old[i][t], case.new[i][t], case.adv[i][t]
        r = math.exp(n - o)
        ratio_clipped = -a * clamp(r, 1 - LOW, 1 + HIGH) > -a * r
        cov = (a - mean_a) * (n - mean_lp)
        if not ratio_clipped and COV_LB < cov < COV_UB:
            candidates.append((i, t))
    k = max(int(COV_RATIO * len(valid)), 1)
    perm = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(COV_SEED)).tolist()
    cut = {candidates[j] for j in perm[:k]}
    assert 1 < len(cut) < len(candidates), "the case should make the random choice matter"

    def loss(i, t, o, n, a, w):
        r = math.exp(n - o)
        return max(-a * r, -a * clamp(r, 1 - LOW, 1 + HIGH)) * (0.0 if (i, t) in cut else 1.0) * w

    metrics = {
        "actor/pg_clipfrac": ref_masked_mean(
            per_token(case, lambda i, t, *_: float((i, t) in cut)), case.mask
        ),
        "actor/ppo_kl": ref_masked_mean(per_token(case, lambda i, t, o, n, a, w: o - n), case.mask),
    }
    return ref_agg(per_token(case, loss), case.mask, mode), metrics


KL_COV_RATIO, KL_COEF = 0.2, 0.7


def ref_kl_cov(case, mode):
    valid = [(i, t) for i, t, *_ in cells(case) if case.mask[i][t]]
    mean_a = sum(case.adv[i][t] for i, t in valid) / len(valid)
    mean_lp = sum(case.new[i][t] for i, t in valid) / len(valid)
    cov = {(i, t): (case.adv[i][t] - mean_a) * (case.new[i][t] - mean_lp) for i, t in valid}
    k = max(1, int(len(valid) * KL_COV_RATIO))
    top = set(sorted(valid, key=lambda it: cov[it], reverse=True)[:k])

    def loss(i, t, o, n, a, w):
        return (-a * math.exp(n - o) + (KL_COEF * abs(n - o) if (i, t) in top else 0.0)) * w

    metrics = {
        "actor/ppo_kl": ref_masked_mean(per_token(case, lambda i, t, o, n, a, w: abs(n - o)), case.mask)
    }
    return ref_agg(per_token(case, loss), case.mask, mode), metrics


def ref_dppo(case, mode, binary_kl):
    def terms(i, t, o, n, a, w):
        r = math.exp(clamp(n - o, -20, 20))
        p, po = math.exp(n), math.exp(o)
        if binary_kl:
            d = po * (o - n) + (1 - po) * math.log((1 - po + 1e-8) / (1 - p + 1e-8))
            valid = (d <= HIGH or p <= po) if a > 0 else (d <= LOW or p >= po)
        else:
            valid = (p - po <= HIGH) if a > 0 else (p - po >= -LOW)
        return -a * min(r, CLIP_C) * n * valid * w, 1.0 - valid, float(r > CLIP_C) * valid

    tok = per_token(case, terms)
    metrics = {
        "actor/pg_clipfrac": ref_masked_mean([[x[1] for x in r] for r in tok], case.mask),
        "actor/ppo_kl": ref_masked_mean(per_token(case, lambda i, t, o, n, a, w: o - n), case.mask),
        "actor/pg_clipfrac_lower": ref_masked_mean([[x[2] for x in r] for r in tok], case.mask),
    }
    return ref_agg([[x[0] for x in r] for r in tok], case.mask, mode), metrics


DRO_BETA = 0.4


def ref_dro(case, mode):
    loss = per_token(case, lambda i, t, o, n, a, w: -(n * a - 0.5 * DRO_BETA * (n - o) ** 2) * w)
    metrics = {"actor/ppo_kl": ref_masked_mean(per_token(case, lambda i, t, o, n, a, w: o - n), case.mask)}
    return ref_agg(loss, case.mask, mode), metrics


CLIP = {"cliprange": 0.2, "cliprange_low": LOW, "cliprange_high": HIGH}
# mode -> (the reference, the knobs given to the registered function)
MODES = {
    "gspo": (ref_gspo, CLIP),
    "sapo": (ref_sapo, {"tau_pos": 1.0, "tau_neg": 1.05}),
    "gpg": (ref_gpg, {}),
    "cispo": (ref_cispo, CLIP),
    "geo_mean": (ref_geo_mean, CLIP),
    "clip_cov": (
        ref_clip_cov,
        {**CLIP, "clip_cov_ratio": COV_RATIO, "clip_cov_lb": COV_LB, "clip_cov_ub": COV_UB},
    ),
    "kl_cov": (ref_kl_cov, {"kl_cov_ratio": KL_COV_RATIO, "ppo_kl_coef": KL_COEF}),
    "dppo_tv": (lambda case, mode: ref_dppo(case, mode, binary_kl=False), {**CLIP, "clip_ratio_c": CLIP_C}),
    "dppo_kl": (lambda case, mode: ref_dppo(case, mode, binary_kl=True), {**CLIP, "clip_ratio_c": CLIP_C}),
    "dro": (ref_dro, {"dro_beta": DRO_BETA}),
}


def knobs_of(name):
    knobs = dict(MODES[name][1])
    if name == "clip_cov":
        knobs["generator"] = torch.Generator().manual_seed(COV_SEED)
    return knobs


@pytest.mark.parametrize("weighted", [False, True], ids=["no-is-weights", "is-weights"])
@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(MODES))
def test_policy_loss_mode_is_verls(name, agg_mode, weighted):
    reference = MODES[name][0]
    seen = {key: 0.0 for key in policy_loss_info(name).metrics}
    for seed in range(3):
        # geo_mean: verl averages over every row; without an empty one that is rlmesh's mean
        case = Case(seed, weighted, empty_row=name != "geo_mean")
        want_loss, want_metrics = reference(case, agg_mode)
        loss, metrics = case.run(get_policy_loss_fn(name), agg_mode, **knobs_of(name))
        # rel 1e-7: verl's (and rlmesh's) `n_i + 1e-8` of an integer mask is a float32 sum
        assert loss.item() == pytest.approx(want_loss, rel=1e-7, abs=1e-12), (name, agg_mode, seed)
        assert set(metrics) == set(want_metrics) == set(seen), name
        for key, value in want_metrics.items():
            # fractions are float32 means, as verl's (.float())
            assert metrics[key].item() == pytest.approx(value, rel=1e-6, abs=1e-12), (name, key, seed)
            seen[key] = max(seen[key], abs(value))
    # Not degenerate: every metric verl computes (rather than reports as 0) was non-zero somewhere.
    constant_zero = {"gspo": {"actor/pg_clipfrac_lower"}, "cispo": {"actor/pg_clipfrac_lower"},
                     "sapo": {"actor/pg_clipfrac", "actor/pg_clipfrac_lower"}}.get(name, set())  # fmt: skip
    assert all(v > 0 for k, v in seen.items() if k not in constant_zero), seen


def test_vanilla_in_the_registry_is_compute_policy_loss():
    case = Case(0, weighted=True)
    for mode in LOSS_AGG_MODES:
        loss, metrics = case.run(compute_policy_loss_vanilla, mode, **CLIP, clip_ratio_c=CLIP_C)
        want = compute_policy_loss(
            case.t_old, case.t_new, case.t_adv, case.t_mask, **CLIP, clip_ratio_c=CLIP_C,
            loss_agg_mode=mode, rollout_is_weights=case.t_w,
        )  # fmt: skip
        got = (
            loss,
            metrics["actor/pg_clipfrac"],
            metrics["actor/ppo_kl"],
            metrics["actor/pg_clipfrac_lower"],
        )
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_geo_mean_averages_over_non_empty_sequences():
    # verl's torch.mean would also count the empty row (with loss 0); rlmesh's mean is over the
    # sequences with a token, like the seq-mean-* modes, so that it normalises over a global batch.
    case = Case(4, weighted=False)
    assert case.mask[2] == [0] * 7
    loss, _ = case.run(compute_policy_loss_geo_mean, "token-mean", **CLIP)
    keep = [0, 1, 3, 4]
    sub = Case(4, weighted=False)
    sub.old, sub.new, sub.adv, sub.mask, sub.w = (
        [x[i] for i in keep] for x in (sub.old, sub.new, sub.adv, sub.mask, sub.w)
    )
    want, _ = ref_geo_mean(sub, "token-mean")
    assert loss.item() == pytest.approx(want, rel=1e-7)


@pytest.mark.parametrize("name", sorted(set(MODES) - {"clip_cov", "kl_cov"}))
def test_policy_loss_mode_of_micro_batches_sums_to_the_global_batch_loss(name):
    """With verl's global_batch_info every mode's micro-batch losses add up (over ranks, / dp) to
    the loss of the whole batch. (clip_cov and kl_cov choose their tokens per call, as verl.)"""
    case = Case(5, weighted=True, bs=8)
    fn, knobs = get_policy_loss_fn(name), knobs_of(name)
    n_tokens, n_seqs = case.t_mask.sum(), (case.t_mask.sum(-1) > 0).sum()
    for mode in LOSS_AGG_MODES:
        whole, _ = case.run(fn, mode, **knobs)
        dp = 2
        parts = sum(
            fn(case.t_old[i : i + 2], case.t_new[i : i + 2], case.t_adv[i : i + 2], case.t_mask[i : i + 2],
               loss_agg_mode=mode, rollout_is_weights=case.t_w[i : i + 2], dp_size=dp,
               batch_num_tokens=n_tokens, global_batch_size=n_seqs, loss_scale_factor=7, **knobs)[0]
            for i in range(0, 8, 2)
        )  # fmt: skip
        torch.testing.assert_close(parts / dp, whole, msg=f"{name} {mode}")


@pytest.mark.parametrize("name", sorted(MODES))
def test_masked_positions_never_change_the_mode_losses(name):
    case = Case(6, weighted=True)
    junk = lambda x: torch.where(case.t_mask.bool(), x, torch.full_like(x, float("nan")))  # noqa: E731
    fn = get_policy_loss_fn(name)
    for mode in LOSS_AGG_MODES:
        clean, clean_metrics = case.run(fn, mode, **knobs_of(name))
        dirty, dirty_metrics = fn(
            junk(case.t_old), junk(case.t_new), junk(case.t_adv), case.t_mask,
            loss_agg_mode=mode, rollout_is_weights=junk(case.t_w), **knobs_of(name),
        )  # fmt: skip
        assert torch.equal(clean, dirty), (name, mode)
        assert all(torch.equal(clean_metrics[k], dirty_metrics[k]) for k in clean_metrics), name


def test_gspo_gradient_is_the_sequence_ratio_times_the_token_score():
    """d/dlogπ_{i,t} of GSPO-token (token-mean) is -A·s_i·w/N where the clip is not taken, 0 where
    it is: no gradient crosses tokens (the sequence ratio is a constant), unlike a plain
    sequence ratio, whose derivative would spread over the whole row."""
    case = Case(7, weighted=True)
    new = case.t_new.clone().requires_grad_()
    loss, _ = compute_policy_loss_gspo(
        case.t_old, new, case.t_adv, case.t_mask, "token-mean", case.t_w, **CLIP
    )
    loss.backward()
    n_tokens = sum(map(sum, case.mask))
    seq_ratio = [
        math.exp(sum((b - a) * m for a, b, m in zip(o, n, mr, strict=True)) / max(sum(mr), 1))
        for o, n, mr in zip(case.old, case.new, case.mask, strict=True)
    ]
    taken = per_token(  # 1 where the unclipped branch is the loss (its gradient flows)
        case, lambda i, t, o, n, a, w: float(-a * clamp(seq_ratio[i], 1 - LOW, 1 + HIGH) <= -a * seq_ratio[i])
    )
    want = per_token(
        case, lambda i, t, o, n, a, w: -a * seq_ratio[i] * w / n_tokens * taken[i][t] * case.mask[i][t]
    )
    valid_taken = [
        x for tr, mr in zip(taken, case.mask, strict=True) for x, m in zip(tr, mr, strict=True) if m
    ]
    assert 0 < sum(valid_taken) < len(valid_taken)  # both branches occur
    torch.testing.assert_close(new.grad, torch.tensor(want, dtype=F64))


def test_cispo_gradient_keeps_every_token_with_the_clipped_ratio_as_a_weight():
    """d/dlogπ of CISPO (token-mean) is -clip(ρ)·A·w/N on every valid token, clipped or not: the
    weight is a constant (PPO's clip would zero the clipped tokens' gradient)."""
    case = Case(8, weighted=True)
    new = case.t_new.clone().requires_grad_()
    loss, metrics = compute_policy_loss_cispo(
        case.t_old, new, case.t_adv, case.t_mask, "token-mean", case.t_w, **CLIP
    )
    loss.backward()
    n_tokens = sum(map(sum, case.mask))
    want = per_token(
        case,
        lambda i, t, o, n, a, w: (
            -clamp(math.exp(n - o), 1 - LOW, 1 + HIGH) * a * w / n_tokens * case.mask[i][t]
        ),
    )
    assert 0 < metrics["actor/pg_clipfrac"].item() < 1
    torch.testing.assert_close(new.grad, torch.tensor(want, dtype=F64))


def test_clip_cov_choice_follows_the_generator():
    case = Case(9, weighted=False)

    def loss(seed):
        knobs = knobs_of("clip_cov") | {"generator": torch.Generator().manual_seed(seed)}
        return case.run(compute_policy_loss_clip_cov, "token-mean", **knobs)[0].item()

    assert loss(1) == loss(1)  # the same seed cuts the same tokens
    assert loss(1) != loss(2)  # another seed other ones


def test_mode_arguments_are_checked():
    case = Case(0, weighted=False)
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        case.run(compute_policy_loss_clip_cov, "token-mean", **CLIP, clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        case.run(compute_policy_loss_kl_cov, "token-mean", kl_cov_ratio=0.0)
    with pytest.raises(ValueError, match="dro_beta"):
        case.run(get_policy_loss_fn("dro"), "token-mean")
    with pytest.raises(ValueError, match="cliprange"):
        case.run(compute_policy_loss_gspo, "token-mean")
    assert policy_loss_info("sapo").loss_agg_mode == "seq-mean-token-mean"
    assert policy_loss_info("gpg").metrics == ()


# ---------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    # clip 0.2:
    #   vpred 1.0, old 0.5, ret 2.0: clipped to 0.7; (1-2)^2 = 1, (0.7-2)^2 = 1.69 -> 1.69, clipped
    #   vpred 2.0, old 2.5, ret 1.0: clipped to 2.3; 1 vs 1.69 -> 1.69, clipped
    #   vpred 0.0, old 0.0, ret 1.0: inside; 1 vs 1 -> 1, not clipped
    #   fourth token masked
    vpreds = torch.tensor([[1.0, 2.0, 0.0, 50.0]], dtype=F64)
    values = torch.tensor([[0.5, 2.5, 0.0, -50.0]], dtype=F64)
    returns = torch.tensor([[2.0, 1.0, 1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, 0.2)
    assert vf_loss.item() == pytest.approx(0.5 * (1.69 + 1.69 + 1.0) / 3)
    assert vf_clipfrac.item() == pytest.approx(2 / 3)
    vf_sum, _ = compute_value_loss(vpreds, returns, values, mask, 0.2, loss_agg_mode="seq-mean-token-sum")
    assert vf_sum.item() == pytest.approx(0.5 * (1.69 + 1.69 + 1.0))


def test_value_loss_gradcheck_at_smooth_points():
    values = torch.tensor([[0.5, 2.5, 0.0], [1.0, -1.0, 0.3]], dtype=F64)
    returns = torch.tensor([[2.0, 1.0, 1.0], [0.2, -0.4, 3.0]], dtype=F64)
    vpreds = torch.tensor([[1.0, 2.0, 0.05], [1.1, -0.2, 0.45]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert torch.autograd.gradcheck(lambda v: compute_value_loss(v, returns, values, mask, 0.2)[0], (vpreds,))


# ---------------------------------------------------------------- entropy loss


def test_entropy_loss_by_hand():
    # Row 0 uniform over 4 -> log 4; row 1 [0, log 2, log 3] -> H of (1/6, 1/3, 1/2) (padded with -inf-ish).
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(2), math.log(3), -1e4]]],
        dtype=F64,
    )
    h1 = -(1 / 6 * math.log(1 / 6) + 1 / 3 * math.log(1 / 3) + 1 / 2 * math.log(1 / 2))
    mask = torch.tensor([[1, 1]])
    assert compute_entropy_loss(logits, mask).item() == pytest.approx((math.log(4) + h1) / 2)
    assert compute_entropy_loss(logits, torch.tensor([[1, 0]])).item() == pytest.approx(math.log(4))
