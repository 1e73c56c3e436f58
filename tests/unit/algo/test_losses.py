import math

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
    compute_value_loss,
    get_policy_loss_fn,
    register_policy_loss,
)

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
    assert get_policy_loss_fn("vanilla") is compute_policy_loss
    with pytest.raises(ValueError, match=r"'gspo'.*vanilla"):
        get_policy_loss_fn("gspo")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a: None)
    assert set(POLICY_LOSS_REGISTRY) == {"vanilla"}


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
