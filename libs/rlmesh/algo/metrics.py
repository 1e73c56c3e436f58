"""Diagnostics the learner logs every step: clip fraction, approximate KL, batch statistics.

docs/algorithms.md#log-probabilities-and-metrics"""

from __future__ import annotations

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
        ``{"mean", "max", "min"}`` as floats; all 0.0 when nothing is valid.
    """
    selected = torch.masked_select(values, mask.bool())
    if selected.numel() == 0:
        return {"mean": 0.0, "max": 0.0, "min": 0.0}
    return {"mean": selected.mean().item(), "max": selected.max().item(), "min": selected.min().item()}


def compute_data_metrics(
    advantages: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
) -> dict[str, float]:
    """Advantage, return and value statistics over valid tokens, and the critic's explained variance.

    .. math:: \\mathrm{EV} = 1 - \\frac{\\mathrm{Var}(R - V)}{\\mathrm{Var}(R) + 10^{-5}}

    (unbiased variances over the valid tokens).

    Args:
        advantages: ``(bs, response_length)``.
        returns: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        values: ``(bs, response_length)``, when a critic is used.

    Returns:
        ``critic/advantages/{mean,max,min}``, ``critic/returns/{mean,max,min}`` and, with
        ``values``, ``critic/values/{mean,max,min}`` and ``critic/vf_explained_var``.
    """
    metrics: dict[str, float] = {}
    for name, tensor in (("advantages", advantages), ("returns", returns)):
        for stat, value in masked_stats(tensor, response_mask).items():
            metrics[f"critic/{name}/{stat}"] = value
    if values is not None:
        for stat, value in masked_stats(values, response_mask).items():
            metrics[f"critic/values/{stat}"] = value
        mask = response_mask.bool()
        valid_returns = torch.masked_select(returns, mask)
        valid_values = torch.masked_select(values, mask)
        if valid_returns.numel() > 1:
            explained = 1.0 - torch.var(valid_returns - valid_values) / (torch.var(valid_returns) + 1e-5)
            metrics["critic/vf_explained_var"] = explained.item()
        else:
            metrics["critic/vf_explained_var"] = 0.0
    return metrics
