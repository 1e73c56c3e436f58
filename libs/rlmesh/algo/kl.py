"""KL estimators, KL-in-reward shaping and the KL coefficient controllers.

docs/algorithms.md#kl-in-reward--algorithmuse_kl_in_reward-algorithmkl_penalty-algorithmkl_ctrl"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from rlmesh.algo.masked import masked_mean

__all__ = [
    "KL_PENALTY_NAMES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "apply_kl_penalty",
    "compute_rewards",
    "get_kl_controller",
    "kl_penalty",
    "kl_penalty_forward",
    "place_scores_on_last_token",
]

KL_PENALTY_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def _allowed_kl_names() -> list[str]:
    return [*KL_PENALTY_NAMES, *(name + "+" for name in KL_PENALTY_NAMES)]


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of :math:`KL(\\pi \\| \\pi_{ref})` from samples of :math:`\\pi`.

    With :math:`d = \\log\\pi - \\log\\pi_{ref}`:

    - ``kl`` / ``k1``: :math:`d`
    - ``abs``: :math:`|d|`
    - ``mse`` / ``k2``: :math:`\\tfrac12 d^2`
    - ``low_var_kl`` / ``k3``: :math:`e^{-d} + d - 1`, with :math:`d` clamped to
      :math:`[-20, 20]` and the result clamped to :math:`[0, 10]`

    Args:
        logprob: ``(bs, response_length)``.
        ref_logprob: ``(bs, response_length)``.
        kl_penalty: estimator name (no ``+`` suffix).

    Returns:
        ``(bs, response_length)``.

    Raises:
        ValueError: unknown name.
    """
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        kld = torch.exp(log_ratio) - log_ratio - 1
        # verl clamps to [-10, 10]; k3 >= 0 exactly, so a lower bound of 0 only removes float
        # rounding below zero (at most one ulp of 1 near d = 0).
        return torch.clamp(kld, min=0, max=10)
    raise ValueError(f"unknown kl_penalty {kl_penalty!r}; allowed: {_allowed_kl_names()}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate, optionally with k2's gradient (the ``+`` forms).

    For a name ending in ``+`` (``k1+``, ``k3+``, ``low_var_kl+``, ...) the value is that of the
    base estimator and the gradient that of k2, whose expected gradient is the true KL gradient:

    .. math::
        \\mathrm{KL}^{+} = k_2 - \\mathrm{sg}(k_2) + \\mathrm{sg}(k_{base})

    where :math:`\\mathrm{sg}` stops gradients. Otherwise see :func:`kl_penalty_forward`.

    Args:
        logprob: ``(bs, response_length)``.
        ref_logprob: ``(bs, response_length)``.
        kl_penalty: ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``, each optionally
            followed by ``+`` (``algorithm.kl_penalty`` or ``actor.kl_loss_type``).

    Returns:
        ``(bs, response_length)``.

    Raises:
        ValueError: unknown name.
    """
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


def _kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    # Body of kl_penalty; apply_kl_penalty's argument (named as in verl) shadows that function.
    base = name[:-1] if name.endswith("+") else name
    if base not in KL_PENALTY_NAMES:
        raise ValueError(f"unknown kl_penalty {name!r}; allowed: {_allowed_kl_names()}")
    forward_score = kl_penalty_forward(logprob, ref_logprob, base)
    if base == name or base in ("mse", "k2"):
        return forward_score
    # k1 and k3 are unbiased in value but not in gradient; k2's gradient is, so route it through.
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


def compute_rewards(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    kl_ratio: float,
) -> torch.Tensor:
    """Token rewards with the k1 KL penalty.

    .. math:: r_t = s_t - \\beta (\\log\\pi_{old} - \\log\\pi_{ref})

    Args:
        token_level_scores: ``(bs, response_length)``.
        old_log_prob: ``(bs, response_length)``.
        ref_log_prob: ``(bs, response_length)``.
        kl_ratio: :math:`\\beta`.

    Returns:
        ``(bs, response_length)``.
    """
    kl = old_log_prob - ref_log_prob
    return token_level_scores - kl * kl_ratio


def place_scores_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's score on its last valid response token.

    .. math:: s_{i,t} = \\mathrm{score}_i \\cdot [t = \\max\\{t' : m_{i,t'} = 1\\}]

    Args:
        scores: ``(bs,)``.
        response_mask: ``(bs, response_length)``.

    Returns:
        ``(bs, response_length)`` token-level scores in ``scores``' dtype; a response with no
        valid token gets an all-zero row.
    """
    valid = response_mask.bool()
    length = valid.shape[-1]
    positions = torch.arange(length, device=valid.device).expand_as(valid)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=-1)
    token_level_scores = torch.zeros(valid.shape, dtype=scores.dtype, device=scores.device)
    has_token = last >= 0
    rows = torch.arange(valid.shape[0], device=valid.device)[has_token]
    token_level_scores[rows, last[has_token]] = scores[has_token]
    return token_level_scores


class KLController(Protocol):
    """What :func:`apply_kl_penalty` needs from a controller."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController | float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, float]:
    """KL in reward, as verl's trainer applies it (``algorithm.use_kl_in_reward``).

    .. math::
        \\mathrm{kl}_{i,t} = m_{i,t}\\, k(\\log\\pi_{old}, \\log\\pi_{ref}), \\qquad
        r_{i,t} = s_{i,t} - \\beta\\, \\mathrm{kl}_{i,t}

        \\mathrm{KL}_{batch} = \\frac{1}{bs}\\sum_i \\frac{\\sum_t \\mathrm{kl}_{i,t}}{\\sum_t m_{i,t} + 10^{-8}}

    Args:
        token_level_scores: ``(bs, response_length)`` scores, normally the sequence score on the
            last valid token (see :func:`place_scores_on_last_token`).
        old_log_prob: ``(bs, response_length)``.
        ref_log_prob: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        kl_ctrl: a controller, or :math:`\\beta` itself. A controller's ``value`` is used as
            :math:`\\beta` and then ``kl_ctrl.update(current_kl, n_steps=bs)`` is called, exactly
            as verl does; read ``kl_ctrl.value`` before the call to log the :math:`\\beta` used.
        kl_penalty: estimator name (``algorithm.kl_penalty``), see :func:`kl_penalty`.

    Returns:
        token_level_rewards: ``(bs, response_length)``.
        current_kl: float, the batch KL above.
    """
    kld = _kl_estimate(old_log_prob, ref_log_prob, kl_penalty)
    # Masked positions count as zero KL, even if the log-probs there are garbage.
    kld = torch.where(response_mask.bool(), kld, torch.zeros((), dtype=kld.dtype, device=kld.device))
    kld = kld * response_mask
    beta = kl_ctrl if isinstance(kl_ctrl, (int, float)) else kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = torch.mean(masked_mean(kld, mask=response_mask, axis=-1), dim=0).item()
    if not isinstance(kl_ctrl, (int, float)):
        kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, current_kl


class FixedKLController:
    """Constant KL coefficient (``algorithm.kl_ctrl.type = fixed``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`.

        Raises:
            ValueError: the state belongs to another controller type.
        """
        _check_state_type(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the KL towards a target (Ziegler et al. 2019).

    .. math::
        e = \\mathrm{clip}\\Big(\\frac{\\mathrm{KL}}{\\mathrm{KL}_{target}} - 1, -0.2, 0.2\\Big),
        \\qquad \\beta \\leftarrow \\beta \\Big(1 + e \\frac{n_{steps}}{H}\\Big)

    so one update moves :math:`\\beta` towards the target by at most
    :math:`20\\% \\cdot n_{steps} / H`.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if horizon <= 0:
            raise ValueError(f"horizon must be greater than 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be greater than 0, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Apply one proportional step.

        Args:
            current_kl: the batch KL (from :func:`apply_kl_penalty`).
            n_steps: samples in the batch.
        """
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        mult = 1 + proportional_error * n_steps / self.horizon
        self.value *= mult

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (the coefficient is the only thing that changes)."""
        return {"type": "adaptive", "value": self.value, "target_kl": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the coefficient from :meth:`state_dict`; target and horizon stay as configured.

        Raises:
            ValueError: the state belongs to another controller type.
        """
        _check_state_type(state, "adaptive")
        self.value = float(state["value"])


def _check_state_type(state: Mapping[str, Any], expected: str) -> None:
    found = state.get("type", expected)
    if found != expected:
        raise ValueError(f"cannot load a {found!r} KL controller state into a {expected!r} controller")


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller described by the ``algorithm.kl_ctrl`` config section.

    Args:
        kl_ctrl: an object with attributes ``type``, ``kl_coef``, ``target_kl``, ``horizon``, or
            a mapping with those keys. ``type`` is ``fixed`` or ``adaptive``.

    Returns:
        ``FixedKLController(kl_coef)`` or ``AdaptiveKLController(kl_coef, target_kl, horizon)``.

    Raises:
        ValueError: unknown type, or a non-positive horizon / target for ``adaptive``.
    """

    def field(name: str) -> Any:
        if isinstance(kl_ctrl, Mapping):
            return kl_ctrl.get(name)
        return getattr(kl_ctrl, name, None)

    ctrl_type = field("type")
    if ctrl_type in ("fixed", "adaptive") and field("kl_coef") is None:
        raise ValueError(f"kl_ctrl.kl_coef is required for a {ctrl_type!r} controller")
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef=field("kl_coef"))
    if ctrl_type == "adaptive":
        return AdaptiveKLController(
            init_kl_coef=field("kl_coef"), target_kl=field("target_kl"), horizon=field("horizon")
        )
    raise ValueError(f"unknown kl_ctrl.type {ctrl_type!r}; allowed: ['fixed', 'adaptive']")
