"""Advantage estimators and their registry, as verl's ``core_algos.py`` has them.

docs/algorithms.md#advantage-estimators--algorithmadv_estimator"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from enum import Enum, StrEnum
from typing import Any

import numpy as np
import torch

from rlmesh.algo.masked import masked_sum, masked_whiten

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "AdvantageEstimator",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_gae_raw_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "get_adv_estimator_fn",
    "group_indices",
    "register_adv_est",
]

AdvEstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATOR_REGISTRY: dict[str, AdvEstimatorFn] = {}


class AdvantageEstimator(StrEnum):
    """Names accepted by ``algorithm.adv_estimator``."""

    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    GPG = "gpg"


def _estimator_name(name_or_enum: str | Enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an advantage estimator under ``name``.

    Registering a different function under a taken name raises ``ValueError`` (as verl does), so
    a plugin cannot silently replace a built-in estimator.
    """
    name = _estimator_name(name_or_enum)

    def decorator(fn: AdvEstimatorFn) -> AdvEstimatorFn:
        existing = ADV_ESTIMATOR_REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered to {existing.__qualname__}")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> AdvEstimatorFn:
    """Look up a registered advantage estimator.

    Raises:
        ValueError: unknown name; the message lists the registered ones.
    """
    name = _estimator_name(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known estimators: {sorted(ADV_ESTIMATOR_REGISTRY)}"
        )
    return ADV_ESTIMATOR_REGISTRY[name]


def group_indices(index: np.ndarray | Sequence[Any] | torch.Tensor) -> list[list[int]]:
    """Batch positions of each group, groups in order of first appearance, positions ascending.

    Args:
        index: ``(bs,)`` group id (uid) of each sample; a numpy array as in verl, a list, or a
            tensor.

    Returns:
        one list of positions per distinct id.
    """
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    groups: dict[Any, list[int]] = {}
    for position, uid in enumerate(index):
        groups.setdefault(uid.item() if isinstance(uid, np.generic) else uid, []).append(position)
    return list(groups.values())


def _check_index(index: Any, bsz: int) -> None:
    if len(index) != bsz:
        raise ValueError(f"index has {len(index)} entries but the batch has {bsz} responses")


def compute_gae_raw_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation before whitening (Schulman et al. 2016).

    Backwards over valid tokens only (masked tokens are skipped: they carry neither a value nor
    a TD error, so multi-turn observation tokens inside a response are jumped over):

    .. math::
        \\delta_t = r_t + \\gamma V_{t'} - V_t, \\qquad
        A_t = \\delta_t + \\gamma \\lambda A_{t'}, \\qquad R_t = A_t + V_t

    where :math:`t'` is the next valid token after :math:`t` (:math:`V_{t'} = A_{t'} = 0` past
    the end). At masked positions the running value and advantage are carried unchanged.

    Args:
        token_level_rewards: ``(bs, response_length)``.
        values: ``(bs, response_length)`` critic values of the rollout.
        response_mask: ``(bs, response_length)``.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        advantages: ``(bs, response_length)``, not whitened.
        returns: ``(bs, response_length)``, ``advantages + values``.
    """
    with torch.no_grad():
        valid = response_mask.bool()
        zeros = torch.zeros_like(values[:, 0])
        next_values = zeros
        last_gae = zeros
        advantages_reversed = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            # Masked positions keep the state of the next valid token (verl's x*m + (1-m)*prev
            # for a 0/1 mask, but NaN-proof).
            next_values = torch.where(valid[:, t], values[:, t], next_values)
            last_gae = torch.where(valid[:, t], gae_t, last_gae)
            advantages_reversed.append(last_gae)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
    return advantages, returns


@register_adv_est(AdvantageEstimator.GAE)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages, whitened over the batch's valid tokens, and returns.

    .. math::
        A = \\mathrm{masked\\_whiten}(A^{GAE}), \\qquad R = A^{GAE} + V

    with :math:`A^{GAE}` from :func:`compute_gae_raw_advantage_return`. Returns are computed from
    the raw advantages (the critic's regression target is not whitened).

    Args:
        token_level_rewards: ``(bs, response_length)``.
        values: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        gamma: discount factor (``algorithm.gamma``).
        lam: GAE lambda (``algorithm.lam``).

    Returns:
        advantages: ``(bs, response_length)``.
        returns: ``(bs, response_length)``.
    """
    with torch.no_grad():
        advantages, returns = compute_gae_raw_advantage_return(
            token_level_rewards, values, response_mask, gamma, lam
        )
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024): the score normalised within its prompt's group.

    .. math::
        s_i = \\sum_t m_{i,t} r_{i,t}, \\qquad
        A_i = \\frac{s_i - \\mathrm{mean}_g(s)}{\\mathrm{std}_g(s) + \\epsilon}
        \\;\\text{(or } s_i - \\mathrm{mean}_g(s) \\text{ without std, Dr.GRPO)}

    ``std`` is the unbiased sample std. A group of one sample uses mean 0 and std 1, so its
    advantage is :math:`s_i / (1 + \\epsilon)` (verl's convention). :math:`A_i` is broadcast over
    the response and masked.

    Args:
        token_level_rewards: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        index: ``(bs,)`` prompt uid of each sample (numpy array, as in verl).
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the group std (``algorithm.norm_adv_by_std_in_grpo``).

    Returns:
        advantages: ``(bs, response_length)``.
        returns: ``(bs, response_length)``, the same tensor as ``advantages``.
    """
    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)
        _check_index(index, scores.shape[0])
        normalised = scores.clone()
        for positions in group_indices(index):
            rows = torch.tensor(positions, device=scores.device)
            group_scores = scores[rows]
            if len(positions) == 1:
                mean = torch.tensor(0.0, device=scores.device)
                std = torch.tensor(1.0, device=scores.device)
            else:
                mean = torch.mean(group_scores)
                std = torch.std(group_scores)
            if norm_adv_by_std_in_grpo:
                normalised[rows] = (group_scores - mean) / (std + epsilon)
            else:
                normalised[rows] = group_scores - mean
        advantages = normalised.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO outcome advantage (Ahmadian et al. 2024): the score minus the mean of the others.

    .. math::
        A_i = s_i - \\frac{1}{n-1}\\sum_{j \\ne i} s_j
            = \\frac{n}{n-1} s_i - \\frac{n}{n-1} \\mathrm{mean}_g(s)

    computed in the second form, as verl does. A group of one sample keeps :math:`A_i = s_i`.

    Args:
        token_level_rewards: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        index: ``(bs,)`` prompt uid of each sample.
        epsilon: unused; kept for verl's signature.

    Returns:
        advantages: ``(bs, response_length)``.
        returns: ``(bs, response_length)``, the same tensor as ``advantages``.
    """
    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)
        _check_index(index, scores.shape[0])
        out = scores.clone()
        for positions in group_indices(index):
            n = len(positions)
            if n == 1:
                continue
            rows = torch.tensor(positions, device=scores.device)
            group_scores = scores[rows]
            mean = torch.mean(group_scores)
            out[rows] = group_scores * n / (n - 1) - mean * n / (n - 1)
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go, whitened over the batch.

    .. math::
        G_t = r_t + \\gamma \\, m_t \\, G_{t+1}, \\qquad A = \\mathrm{masked\\_whiten}(G) \\cdot m

    (the running return is reset to zero after a masked token, i.e. past the end of the
    response).

    Args:
        token_level_rewards: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        gamma: discount factor (``algorithm.gamma``).

    Returns:
        advantages: ``(bs, response_length)``.
        returns: ``(bs, response_length)``, :math:`G` before whitening.
    """
    with torch.no_grad():
        valid = response_mask.bool()
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        zero = torch.zeros((), dtype=running.dtype, device=running.device)
        for t in reversed(range(token_level_rewards.shape[-1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = torch.where(valid[:, t], running, zero)
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline, whitened over the batch.

    .. math::
        A_{i,t} = \\mathrm{masked\\_whiten}\\big((s_i - \\mathrm{mean}_g(s))\\, m_{i,t}\\big)\\, m_{i,t}

    A group of one sample uses mean 0.

    Args:
        token_level_rewards: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        index: ``(bs,)`` prompt uid of each sample.
        epsilon: unused; kept for verl's signature.

    Returns:
        advantages: ``(bs, response_length)``.
        returns: ``(bs, response_length)``, the same tensor as ``advantages``.
    """
    with torch.no_grad():
        response_length = token_level_rewards.shape[-1]
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)
        _check_index(index, scores.shape[0])
        centred = scores.clone()
        for positions in group_indices(index):
            if len(positions) == 1:
                continue  # centred on a mean of 0
            rows = torch.tensor(positions, device=scores.device)
            group_scores = scores[rows]
            centred[rows] = group_scores - torch.mean(group_scores)
        advantages = centred.unsqueeze(-1).tile([1, response_length]) * response_mask
        advantages = masked_whiten(advantages, response_mask) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REMAX)
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): the reward-to-go minus the score of the prompt's greedy response.

    .. math::
        R_{i,t} = \\sum_{t' \\ge t} m_{i,t'} r_{i,t'}, \\qquad A_{i,t} = R_{i,t} - b_i \\, m_{i,t}

    undiscounted; :math:`b_i` is the reward service's score of the greedy (temperature 0)
    response to sample :math:`i`'s prompt, with no KL term. With KL in the reward, :math:`r`
    holds the per-token penalty, so :math:`R` includes it.

    Args:
        token_level_rewards: ``(bs, response_length)``.
        reward_baselines: ``(bs,)`` the greedy response's score for each sample's prompt.
        response_mask: ``(bs, response_length)``.

    Returns:
        advantages: ``(bs, response_length)``.
        returns: ``(bs, response_length)``, :math:`R`.
    """
    with torch.no_grad():
        # verl's rewards * mask, but NaN-proof: junk at masked positions never reaches the sums.
        rewards = torch.where(
            response_mask.bool(), token_level_rewards, torch.zeros_like(token_level_rewards)
        )
        returns = rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.GPG)
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG outcome advantage (Chu et al. 2025, "GPG: a simple and strong baseline"): the score minus
    its group's mean, scaled up by how few samples of the batch score at all.

    .. math::
        A_i = \\alpha\\,\\frac{s_i - \\mathrm{mean}_g(s)}{F_{norm}},
        \\qquad \\alpha = \\frac{B}{\\max(1, |\\{j : s_j \\ne 0\\}|)}

    over the whole batch of :math:`B` samples (verl's ``alpha`` argument is overwritten the same
    way). A group of one sample has mean 0. Paired with ``policy_loss.loss_mode=gpg``.

    Args:
        token_level_rewards: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        index: ``(bs,)`` prompt uid of each sample.
        epsilon: unused; kept for verl's signature.
        f_norm: :math:`F_{norm}` (verl's default 1).
        alpha: unused: computed from the batch, as verl does.

    Returns:
        advantages: ``(bs, response_length)``.
        returns: ``(bs, response_length)``, the same tensor as ``advantages``.
    """
    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)
        _check_index(index, scores.shape[0])
        alpha = scores.shape[0] / max(1, int(torch.count_nonzero(scores)))
        means = torch.zeros_like(scores)
        for positions in group_indices(index):
            if len(positions) > 1:
                rows = torch.tensor(positions, device=scores.device)
                means[rows] = torch.mean(scores[rows])
        advantages = (alpha * (scores - means) / f_norm).unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_advantage(
    adv_estimator: str | AdvantageEstimator,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    index: np.ndarray | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a registered estimator, passing only the inputs its signature names.

    Estimators take different inputs (GAE needs ``values``, GRPO needs ``index``, ReMax
    ``reward_baselines``); this is the one call site the learner needs for
    ``algorithm.adv_estimator``.

    Args:
        adv_estimator: a registered name.
        token_level_rewards: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        values: ``(bs, response_length)``, for estimators that use a critic.
        index: ``(bs,)`` prompt uids, for group-based estimators.
        reward_baselines: ``(bs,)`` greedy-response scores, for ``remax``.
        gamma, lam, norm_adv_by_std_in_grpo: forwarded when the estimator accepts them.
        extra: further keyword inputs for custom estimators.

    Returns:
        advantages, returns: ``(bs, response_length)`` each.

    Raises:
        ValueError: unknown estimator, or an input it requires is missing.
    """
    fn = get_adv_estimator_fn(adv_estimator)
    available: dict[str, Any] = {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask,
        "values": values,
        "index": index,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
        **extra,
    }
    params = inspect.signature(fn).parameters
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    for name, param in params.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name in available and available[name] is not None:
            kwargs[name] = available[name]
        elif param.default is inspect.Parameter.empty:
            raise ValueError(f"advantage estimator {_estimator_name(adv_estimator)!r} needs {name!r}")
    if takes_var_kw:
        kwargs.update({k: v for k, v in available.items() if k not in kwargs and v is not None})
    return fn(**kwargs)
