import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.algo import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
    place_scores_on_last_token,
)

F64 = torch.float64
LN2 = math.log(2)

# logprob = log 0.5, ref = log 0.25 -> d = ln 2; and the reverse -> d = -ln 2.
LOGPROB = torch.tensor([math.log(0.5), math.log(0.25)], dtype=F64)
REF = torch.tensor([math.log(0.25), math.log(0.5)], dtype=F64)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("kl", [LN2, -LN2]),
        ("k1", [LN2, -LN2]),
        ("abs", [LN2, LN2]),
        ("mse", [0.5 * LN2**2, 0.5 * LN2**2]),
        ("k2", [0.5 * LN2**2, 0.5 * LN2**2]),
        # e^{-d} + d - 1: 0.5 + ln2 - 1 and 2 - ln2 - 1
        ("low_var_kl", [LN2 - 0.5, 1 - LN2]),
        ("k3", [LN2 - 0.5, 1 - LN2]),
    ],
)
def test_kl_estimators_by_hand(name, expected):
    assert kl_penalty(LOGPROB, REF, name).tolist() == pytest.approx(expected)
    assert kl_penalty_forward(LOGPROB, REF, name).tolist() == pytest.approx(expected)
    # the "+" form has the same value
    assert kl_penalty(LOGPROB, REF, name + "+").tolist() == pytest.approx(expected)


def test_k3_is_clamped():
    # ref - logprob = 30 -> clamped to 20 -> e^20 - 21, then clamped to 10.
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "k3").item() == 10.0
    # ref - logprob = -30 -> clamped to -20 -> e^-20 + 19 -> 10.
    assert kl_penalty(torch.tensor([30.0]), torch.tensor([0.0]), "k3").item() == 10.0


def test_unknown_kl_penalty_lists_allowed():
    with pytest.raises(ValueError, match=r"'full'.*low_var_kl.*k3\+"):
        kl_penalty(LOGPROB, REF, "full")
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty_forward(LOGPROB, REF, "k4")


@settings(max_examples=60, deadline=None)
@given(
    d=st.lists(st.floats(-30, 30, allow_subnormal=False), min_size=1, max_size=16),
    name=st.sampled_from(["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]),
)
def test_plus_variants_have_base_value_and_k2_gradient(d, name):
    ref = torch.zeros(len(d), dtype=F64)
    logprob = torch.tensor(d, dtype=F64, requires_grad=True)
    plus = kl_penalty(logprob, ref, name + "+")
    assert torch.equal(plus.detach(), kl_penalty(logprob, ref, name).detach())
    (grad,) = torch.autograd.grad(plus.sum(), logprob)
    (k2_grad,) = torch.autograd.grad(kl_penalty(logprob, ref, "k2").sum(), logprob)
    assert torch.equal(grad, k2_grad)
    assert torch.allclose(grad, logprob.detach())  # d/dd of d^2/2


@settings(max_examples=200, deadline=None)
@given(
    logprob=st.lists(st.floats(-40, 0, allow_subnormal=False), min_size=1, max_size=32),
    shift=st.lists(
        st.floats(-1e-6, 1e-6, allow_subnormal=False) | st.floats(-25, 25), min_size=1, max_size=32
    ),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_k2_k3_abs_are_non_negative(logprob, shift, dtype):
    n = min(len(logprob), len(shift))
    lp = torch.tensor(logprob[:n], dtype=dtype)
    ref = lp + torch.tensor(shift[:n], dtype=dtype)
    for name in ("k2", "mse", "k3", "low_var_kl", "abs", "k3+", "low_var_kl+"):
        assert bool((kl_penalty(lp, ref, name) >= 0).all()), name


def test_kl_losses_gradcheck_at_smooth_points():
    ref = torch.tensor([[-1.0, -2.0, -0.3], [-0.8, -1.5, -2.5]], dtype=F64)
    logprob = (ref + torch.tensor([[0.3, -0.4, 0.7], [-0.2, 0.5, -0.9]], dtype=F64)).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    for name in ("kl", "abs", "mse", "low_var_kl"):
        for mode in ("token-mean", "seq-mean-token-sum"):
            assert torch.autograd.gradcheck(
                lambda lp, name=name, mode=mode: agg_loss(kl_penalty(lp, ref, name), mask, mode), (logprob,)
            )


# ---------------------------------------------------------------- KL in reward


def test_compute_rewards_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -0.5, -1.0]])
    # kl = old - ref = [0.5, -0.5, 0]; rewards = scores - 0.1 * kl
    assert compute_rewards(scores, old, ref, 0.1).tolist() == [pytest.approx([-0.05, 0.05, 1.0])]


def test_place_scores_on_last_token():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    assert place_scores_on_last_token(scores, mask).tolist() == [
        [0.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 2.0],
        [0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 4.0, 0.0],
    ]


def _kl_batch():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    scores = place_scores_on_last_token(torch.tensor([1.0, 2.0], dtype=F64), mask)
    ref = torch.zeros(2, 3, dtype=F64)
    old = torch.tensor([[0.2, 0.1, 0.3], [0.4, -0.2, 9.0]], dtype=F64)  # 9.0 sits on padding
    return scores, old, ref, mask


def test_apply_kl_penalty_by_hand_with_a_fixed_beta():
    scores, old, ref, mask = _kl_batch()
    rewards, current_kl = apply_kl_penalty(scores, old, ref, mask, 0.5, kl_penalty="kl")
    # kld = [[0.2, 0.1, 0.3], [0.4, -0.2, 0]]; rewards = scores - 0.5 * kld
    assert rewards.tolist() == [pytest.approx([-0.1, -0.05, 0.85]), pytest.approx([-0.2, 2.1, 0.0])]
    # per-sequence means 0.6 / 3 = 0.2 and 0.2 / 2 = 0.1; batch mean 0.15
    assert current_kl == pytest.approx(0.15)


def test_apply_kl_penalty_updates_the_controller_like_verl():
    scores, old, ref, mask = _kl_batch()
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=100)
    rewards, _ = apply_kl_penalty(scores, old, ref, mask, ctrl)
    # beta 0.5 is used for the rewards; then error = clip(0.15 / 0.1 - 1, +-0.2) = 0.2,
    # n_steps = batch size 2: beta *= 1 + 0.2 * 2 / 100
    assert rewards[0, 2].item() == pytest.approx(0.85)
    assert ctrl.value == pytest.approx(0.5 * 1.004)


# ---------------------------------------------------------------- controllers


def test_fixed_controller():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05


def test_adaptive_controller_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=3.0, n_steps=256)  # error -0.5 clipped to -0.2: * (1 - 0.2 * 256 / 10000)
    assert ctrl.value == pytest.approx(0.2 * 0.99488)
    ctrl.update(current_kl=6.6, n_steps=100)  # error 0.1: * (1 + 0.1 * 100 / 10000)
    assert ctrl.value == pytest.approx(0.2 * 0.99488 * 1.001)
    ctrl.update(current_kl=6.0, n_steps=100)  # on target: unchanged
    assert ctrl.value == pytest.approx(0.2 * 0.99488 * 1.001)


@settings(max_examples=200, deadline=None)
@given(
    beta=st.floats(1e-4, 10.0),
    target=st.floats(1e-3, 10.0),
    current=st.floats(0.0, 100.0),
    n_steps=st.integers(1, 512),
    horizon=st.integers(512, 100_000),
)
def test_adaptive_controller_moves_toward_target_within_bound(beta, target, current, n_steps, horizon):
    ctrl = AdaptiveKLController(beta, target, horizon)
    ctrl.update(current, n_steps)
    change = ctrl.value / beta - 1
    # KL above target -> raise beta to pull KL down; below -> lower it.
    if current > target:
        assert ctrl.value >= beta
    elif current < target:
        assert ctrl.value <= beta
    assert abs(change) <= 0.2 * n_steps / horizon + 1e-12


def test_controller_state_round_trip():
    ctrl = AdaptiveKLController(0.1, 0.05, 1000)
    ctrl.update(0.5, 64)
    restored = AdaptiveKLController(0.1, 0.05, 1000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    assert ctrl.state_dict()["type"] == "adaptive"

    fixed = FixedKLController(0.3)
    fixed_restored = FixedKLController(0.0)
    fixed_restored.load_state_dict(fixed.state_dict())
    assert fixed_restored.value == 0.3
    with pytest.raises(ValueError, match="'adaptive'"):
        fixed_restored.load_state_dict(ctrl.state_dict())


def test_get_kl_controller_from_object_and_dict():
    fixed = get_kl_controller(SimpleNamespace(type="fixed", kl_coef=0.01, target_kl=0.1, horizon=10000))
    assert isinstance(fixed, FixedKLController)
    assert fixed.value == 0.01
    adaptive = get_kl_controller({"type": "adaptive", "kl_coef": 0.02, "target_kl": 0.1, "horizon": 500})
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.02, 0.1, 500)


def test_get_kl_controller_rejects_bad_config():
    with pytest.raises(ValueError, match=r"'pid'.*fixed.*adaptive"):
        get_kl_controller({"type": "pid", "kl_coef": 0.1})
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 0})
    with pytest.raises(ValueError, match="kl_coef"):
        get_kl_controller({"type": "fixed"})
