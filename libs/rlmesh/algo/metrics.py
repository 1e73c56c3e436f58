"""Diagnostics the learner logs every step: clip fraction, approximate KL, batch statistics.

docs/algorithms.md#log-probabilities-and-metrics"""

from __future__ import annotations

import math

import torch

from rlmesh.algo.kl import kl_penalty
from rlmesh.algo.masked import masked_mean

__all__ = ["compute_approx_kl", "compute_clipfrac", "compute_data_metrics", "masked_stats"]


def compute_clipfrac(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float,
) -> torch.Tensor:
    """Fraction of valid tokens whose ratio lies outside the clip interval, whatever the advantage.

    .. math:: \\overline{[\\rho < 1 - \\epsilon_{low}] \\lor [\\rho > 1 + \\epsilon_{high}]},
        \\qquad \\rho = e^{\\log\\pi - \\log\\pi_{old}}

    (``compute_policy_loss``'s ``pg_clipfrac`` counts only tokens where clipping changes the
    loss, which depends on the advantage's sign.)

    Args:
        log_prob: ``(bs, response_length)``.
        old_log_prob: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        cliprange_low, cliprange_high: :math:`\\epsilon_{low}, \\epsilon_{high}`.

    Returns:
        scalar tensor.
    """
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    outside = (ratio < 1 - cliprange_low) | (ratio > 1 + cliprange_high)
    return masked_mean(outside.float(), response_mask)


def compute_approx_kl(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_estimator: str = "k1",
) -> torch.Tensor:
    """Approximate :math:`KL(\\pi_{old} \\| \\pi)` over the valid tokens, sampled from :math:`\\pi_{old}`.

    .. math:: \\widehat{KL} = \\overline{k(\\log\\pi_{old}, \\log\\pi)}

    ``k1`` gives :math:`\\overline{\\log\\pi_{old} - \\log\\pi}` (``ppo_kl``); ``k3`` the
    low-variance :math:`\\overline{\\rho - \\log\\rho - 1}`.

    Args:
        log_prob: ``(bs, response_length)``.
        old_log_prob: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        kl_estimator: any name accepted by :func:`rlmesh.algo.kl.kl_penalty`.

    Returns:
        scalar tensor.
    """
    return masked_mean(kl_penalty(old_log_prob, log_prob, kl_estimator), response_mask)


def masked_stats(values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean, max and min over the valid entries.

    .. math:: \\{\\bar{x}, \\max_{m=1} x, \\min_{m=1} x\\}

    Args:
        values: any shape, e.g. ``(bs, response_length)``.
        mask: same shape.

    Returns:
        ``{"mean", "max", "min"}`` as floats; all NaN when nothing is valid (verl's value then:
        the sinks drop non-finite values, so the step logs no number rather than a made-up 0).
    """
    selected = torch.masked_select(values, mask.bool())
    if selected.numel() == 0:
        return {"mean": math.nan, "max": math.nan, "min": math.nan}
    return {"mean": selected.mean().item(), "max": selected.max().item(), "min": selected.min().item()}


def _stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return {f"{prefix}/{stat}": value for stat, value in masked_stats(values, mask).items()}


def compute_data_metrics(
    token_level_scores: torch.Tensor,
    token_level_rewards: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    max_prompt_length: int,
    max_response_length: int,
    values: torch.Tensor | None = None,
) -> dict[str, float]:
    """verl's ``compute_data_metrics`` (``verl/trainer/ppo/metric_utils.py``, 0.9.1) on tensors.

    With :math:`R` the response width, the lengths come from the attention mask, as in verl:
    :math:`\\ell^p_i = \\sum_t a_{i,t<-R}`, :math:`\\ell^r_i = \\sum_t a_{i,t\\ge -R}`; a sample is
    *aborted* when :math:`\\ell^r_i = 0`.

    - ``critic/score``, ``critic/rewards``: :math:`\\sum_t` ``token_level_scores`` /
      ``token_level_rewards`` of each row (the whole row), over the non-aborted rows;
    - ``critic/advantages``, ``returns``, ``values``: over the tokens with ``response_mask``;
    - ``critic/vf_explained_var``: :math:`1 - \\mathrm{Var}(R - V) / (\\mathrm{Var}(R) + 10^{-5})`,
      unbiased variances over those tokens (NaN with fewer than two);
    - ``response_length``, ``prompt_length``: over every row; ``clip_ratio`` the share of rows at
      the maximum length; ``response_length_non_aborted``: over the non-aborted rows;
      ``response/aborted_ratio`` the share of aborted rows.

    Each is ``/mean``, ``/max``, ``/min`` and NaN when it has nothing to reduce. verl's maxima
    are its tensors' widths, which it pads to the configured lengths; here they are given, as a
    batch may be narrower. A row longer than the maximum counts as clipped.

    Args:
        token_level_scores, token_level_rewards: ``(bs, response_length)``; the rewards include
            the KL-in-reward penalty.
        advantages, returns: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``, the tokens the losses train on.
        attention_mask: ``(bs, prompt_length + response_length)``.
        max_prompt_length, max_response_length: the configured maxima
            (``rollout.prompt_length``, ``rollout.response_length``).
        values: ``(bs, response_length)``, when a critic is used.

    Returns:
        the metrics above under verl's names; ``critic/values/*`` and
        ``critic/vf_explained_var`` only with ``values``.
    """
    width = response_mask.shape[-1]
    prompt_length = attention_mask[:, :-width].sum(dim=-1).float()
    response_length = attention_mask[:, -width:].sum(dim=-1).float()
    rows = torch.ones_like(response_length, dtype=torch.bool)
    non_aborted = response_length > 0
    metrics = {
        **_stats("critic/score", token_level_scores.sum(dim=-1), non_aborted),
        **_stats("critic/rewards", token_level_rewards.sum(dim=-1), non_aborted),
        **_stats("critic/advantages", advantages, response_mask),
        **_stats("critic/returns", returns, response_mask),
    }
    if values is not None:
        metrics.update(_stats("critic/values", values, response_mask))
        mask = response_mask.bool()
        valid_returns = torch.masked_select(returns, mask)
        valid_values = torch.masked_select(values, mask)
        explained = math.nan  # torch.var of one element is NaN too, with a warning
        if valid_returns.numel() > 1:
            var_diff = torch.var(valid_returns - valid_values)
            explained = (1.0 - var_diff / (torch.var(valid_returns) + 1e-5)).item()
        metrics["critic/vf_explained_var"] = explained
    for prefix, lengths, valid, limit in (
        ("response_length", response_length, rows, max_response_length),
        ("response_length_non_aborted", response_length, non_aborted, max_response_length),
        ("prompt_length", prompt_length, rows, max_prompt_length),
    ):
        metrics.update(_stats(prefix, lengths, valid))
        clipped = (lengths[valid] >= limit).float()
        metrics[f"{prefix}/clip_ratio"] = clipped.mean().item() if clipped.numel() else math.nan
    metrics["response/aborted_ratio"] = (~non_aborted).float().mean().item()
    return metrics
