"""Rollout correction: truncated importance sampling between rollout and learner log-probs.

docs/algorithms.md#rollout-correction--algorithmrollout_correction"""

from __future__ import annotations

import math

import torch

from rlmesh.algo.masked import masked_mean, masked_sum

__all__ = [
    "ROLLOUT_IS_LEVELS",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_correction",
    "compute_rollout_correction_weights",
]

ROLLOUT_IS_LEVELS = ("token", "sequence")


def _check_level_and_threshold(rollout_is: str, rollout_is_threshold: float) -> None:
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; allowed: {[None, *ROLLOUT_IS_LEVELS]}")
    if not rollout_is_threshold > 0:
        raise ValueError(f"rollout_is_threshold must be positive, got {rollout_is_threshold}")


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights from the log-ratio :math:`\\log\\pi_{old} - \\log\\pi_{rollout}`.

    .. math::
        \\text{token:}\\quad w_{i,t} = \\min\\big(e^{\\mathrm{clamp}(\\ell_{i,t}, \\pm 20)}, C\\big)\\, m_{i,t}

        \\text{sequence:}\\quad w_{i,t} = \\min\\big(e^{\\mathrm{clamp}(\\sum_{t'} m_{i,t'}\\ell_{i,t'}, \\pm 20)}, C\\big)\\, m_{i,t}

    Token weights are biased with low variance; the sequence weight (product of token ratios) is
    unbiased with high variance. With ``rollout_is_batch_normalize`` the weights are divided by
    their mean (over valid tokens, or over sequences at sequence level). The weights are
    detached: they reweight the objective's measure, they are not part of it.

    Args:
        log_ratio: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        rollout_is: ``token`` or ``sequence``.
        rollout_is_threshold: truncation :math:`C > 0`.
        rollout_is_batch_normalize: rescale the truncated weights to mean 1.

    Returns:
        rollout_is_weights: ``(bs, response_length)``, zero at masked positions.
        metrics: statistics of the truncated weights, before batch normalisation
            (see :func:`compute_is_metrics`), and ``rollout_is_batch_norm_factor``.

    Raises:
        ValueError: unknown ``rollout_is`` or non-positive threshold.
    """
    _check_level_and_threshold(rollout_is, rollout_is_threshold)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    # Garbage log-probs at masked positions must not leak into sums or exponentials.
    log_ratio = torch.where(response_mask.bool(), log_ratio, zero)
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        weights = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:
        log_ratio_for_metrics = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)  # (bs, 1)
        weights = torch.exp(torch.clamp(log_ratio_for_metrics, min=-20.0, max=20.0)).expand_as(log_ratio)
    raw_weights = weights * response_mask
    weights = raw_weights.clamp(max=rollout_is_threshold)

    metrics = compute_is_metrics(
        weights, raw_weights, log_ratio_for_metrics, response_mask, rollout_is, rollout_is_threshold
    )

    weights = weights.detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            weights_mean = masked_mean(weights, response_mask)
        else:
            seq_weights = masked_mean(weights, response_mask, axis=-1)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(weights.dtype)
            weights_mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if weights_mean > 1e-8:
            weights = weights / weights_mean
            metrics["rollout_is_batch_norm_factor"] = weights_mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
) -> dict[str, float]:
    """Statistics of the truncated weights the loss uses; how often raw ratios leave :math:`[1/C, C]`.

    With :math:`w` the truncated weights, :math:`r` the raw ones (before truncation), :math:`C` the
    threshold and means over valid tokens unless noted:

    - ``rollout_is_mean``: :math:`\\bar w`
    - ``rollout_is_max`` / ``_min``: token level, of :math:`w` (so at most :math:`C`); sequence level,
      :math:`e^{\\min(\\max_i L_i, 20)}` / :math:`e^{\\min_i L_i}` with :math:`L_i = \\sum_t m_{i,t}\\ell_{i,t}`
      over every row (untruncated, exact in log space)
    - ``rollout_is_ratio_fraction_high`` / ``_low``: token level, share of valid tokens with
      :math:`r > C` / :math:`r < 1/C`; sequence level, share of rows with :math:`L_i > \\log C` /
      :math:`L_i < -\\log C`
    - ``rollout_is_std``: :math:`\\sqrt{\\overline{w^2} - \\bar w^2}` (0 with a single valid token)
    - ``rollout_is_eff_sample_size``: :math:`1 / \\overline{(w / (\\bar w + 10^{-8}))^2}`
    - ``rollout_is_seq_{mean,std,max,min}``: over rows of the per-row mean :math:`\\bar w_i`
      (std unbiased), ``rollout_is_seq_max_deviation``: :math:`\\max_i |\\bar w_i - 1|`
    - ``rollout_is_seq_fraction_high`` / ``_low``: share of rows whose raw mean :math:`\\bar r_i`
      is above :math:`C` / below :math:`1/C` (a mean of truncated weights never exceeds :math:`C`)

    Args:
        rollout_is_weights: ``(bs, response_length)`` truncated weights, zero when masked.
        raw_rollout_is_weights: ``(bs, response_length)`` weights before truncation, zero when masked.
        log_ratio_for_metrics: ``(bs, response_length)`` for token level, ``(bs, 1)`` for sequence.
        response_mask: ``(bs, response_length)``.
        rollout_is: ``token`` or ``sequence``.
        rollout_is_threshold: :math:`C`.

    Returns:
        dict of floats.

    Raises:
        ValueError: the mask selects no token.
    """
    if not response_mask.bool().any():
        raise ValueError("response_mask must contain at least one valid token")
    threshold_lower = 1.0 / rollout_is_threshold
    metrics: dict[str, float] = {}
    mask_bool = response_mask.bool()

    metrics["rollout_is_mean"] = masked_mean(rollout_is_weights, response_mask).item()
    if rollout_is == "sequence":
        # The truncated weights hide how far the products went; log space keeps them exact.
        log_max = log_ratio_for_metrics.max()
        log_min = log_ratio_for_metrics.min()
        metrics["rollout_is_max"] = torch.exp(torch.clamp(log_max, max=20.0)).item()
        metrics["rollout_is_min"] = torch.exp(log_min).item()
        metrics["rollout_is_ratio_fraction_high"] = (
            (log_ratio_for_metrics > math.log(rollout_is_threshold)).float().mean().item()
        )
        metrics["rollout_is_ratio_fraction_low"] = (
            (log_ratio_for_metrics < math.log(threshold_lower)).float().mean().item()
        )
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean(
            (raw_rollout_is_weights > rollout_is_threshold).float(), response_mask
        ).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean(
            (raw_rollout_is_weights < threshold_lower).float(), response_mask
        ).item()
        metrics["rollout_is_max"] = rollout_is_weights.masked_fill(~mask_bool, float("-inf")).max().item()
        metrics["rollout_is_min"] = rollout_is_weights.masked_fill(~mask_bool, float("inf")).min().item()

    weights_mean = masked_mean(rollout_is_weights, response_mask)
    if response_mask.sum() > 1:
        variance = masked_mean(rollout_is_weights.square(), response_mask) - weights_mean.square()
        metrics["rollout_is_std"] = torch.sqrt(torch.clamp(variance, min=0.0)).item()
    else:
        metrics["rollout_is_std"] = 0.0
    normalised = rollout_is_weights / (weights_mean + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalised.square(), response_mask).item()

    seq_mean_weights = masked_mean(rollout_is_weights, response_mask, axis=-1)  # (bs,)
    metrics["rollout_is_seq_mean"] = seq_mean_weights.mean().item()
    metrics["rollout_is_seq_std"] = seq_mean_weights.std().item() if seq_mean_weights.numel() > 1 else 0.0
    metrics["rollout_is_seq_max"] = seq_mean_weights.max().item()
    metrics["rollout_is_seq_min"] = seq_mean_weights.min().item()
    metrics["rollout_is_seq_max_deviation"] = (seq_mean_weights - 1.0).abs().max().item()
    raw_seq_mean_weights = masked_mean(raw_rollout_is_weights, response_mask, axis=-1)
    metrics["rollout_is_seq_fraction_high"] = (
        (raw_seq_mean_weights > rollout_is_threshold).float().mean().item()
    )
    metrics["rollout_is_seq_fraction_low"] = (raw_seq_mean_weights < threshold_lower).float().mean().item()
    return metrics


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Mismatch between the learner's and the rollout engine's log-probs of the same tokens.

    With :math:`\\ell = \\log\\pi_{old} - \\log\\pi_{rollout}` and means over valid tokens unless noted:

    - ``logprob_abs_diff_mean`` / ``logprob_abs_diff_max``: :math:`|\\ell|`, and
      ``prob_abs_diff_mean`` / ``prob_abs_diff_max``: :math:`|\\pi_{old} - \\pi_{rollout}|`
      (rlmesh's additions; verl has no such keys)
    - ``kl``: :math:`\\overline{-\\ell}` (k1 estimate of :math:`KL(\\pi_{rollout}\\|\\pi_{old})`)
    - ``k3_kl``: :math:`\\overline{e^{\\ell} - \\ell - 1}`
    - ``training_ppl`` / ``rollout_ppl``: batch mean of per-sequence
      :math:`\\exp(-\\overline{\\log\\pi})`; ``training_log_ppl`` / ``rollout_log_ppl`` the same in log space
    - ``log_ppl_diff``: mean over sequences of
      :math:`\\overline{\\log\\pi_{rollout}} - \\overline{\\log\\pi_{old}}` (also ``_abs``, ``_max``, ``_min``)
    - ``ppl_ratio``: mean over sequences of :math:`\\mathrm{PPL}_{old} / \\mathrm{PPL}_{rollout}`
    - ``chi2_token``: :math:`\\overline{\\rho^2} - 1`; ``chi2_seq``:
      mean over sequences of :math:`(\\prod_t \\rho_t)^2 - 1`, :math:`\\rho = e^{\\mathrm{clamp}(\\ell, \\pm20)}`

    Args:
        old_log_prob: ``(bs, response_length)`` learner log-probs.
        rollout_log_prob: ``(bs, response_length)`` rollout engine log-probs.
        response_mask: ``(bs, response_length)``.

    Returns:
        dict of floats.

    Raises:
        ValueError: the mask selects no token.
    """
    mask_bool = response_mask.bool()
    if not mask_bool.any():
        raise ValueError("response_mask must contain at least one valid token")
    zero = torch.zeros((), dtype=old_log_prob.dtype, device=old_log_prob.device)
    old_log_prob = torch.where(mask_bool, old_log_prob, zero)
    rollout_log_prob = torch.where(mask_bool, rollout_log_prob, zero)
    log_ratio = old_log_prob - rollout_log_prob

    metrics: dict[str, float] = {}
    abs_diff = log_ratio.abs()
    metrics["logprob_abs_diff_mean"] = masked_mean(abs_diff, response_mask).item()
    metrics["logprob_abs_diff_max"] = abs_diff.masked_fill(~mask_bool, 0.0).max().item()
    prob_diff = (old_log_prob.exp() - rollout_log_prob.exp()).abs()
    metrics["prob_abs_diff_mean"] = masked_mean(prob_diff, response_mask).item()
    metrics["prob_abs_diff_max"] = prob_diff.masked_fill(~mask_bool, 0.0).max().item()

    mean_log_prob_training = masked_mean(old_log_prob, response_mask, axis=-1)  # (bs,)
    mean_log_prob_rollout = masked_mean(rollout_log_prob, response_mask, axis=-1)  # (bs,)
    metrics["training_ppl"] = torch.exp(-mean_log_prob_training).mean().item()
    metrics["training_log_ppl"] = (-mean_log_prob_training).mean().item()
    metrics["rollout_ppl"] = torch.exp(-mean_log_prob_rollout).mean().item()
    metrics["rollout_log_ppl"] = (-mean_log_prob_rollout).mean().item()

    metrics["kl"] = masked_mean(rollout_log_prob - old_log_prob, response_mask).item()
    metrics["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()

    log_ppl_diff = mean_log_prob_rollout - mean_log_prob_training  # log(PPL_old / PPL_rollout), (bs,)
    metrics["log_ppl_diff"] = log_ppl_diff.mean().item()
    metrics["log_ppl_abs_diff"] = log_ppl_diff.abs().mean().item()
    metrics["log_ppl_diff_max"] = log_ppl_diff.max().item()
    metrics["log_ppl_diff_min"] = log_ppl_diff.min().item()
    metrics["ppl_ratio"] = torch.exp(log_ppl_diff).mean().item()

    rho = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    metrics["chi2_token"] = (masked_mean(rho.square(), response_mask) - 1.0).item()
    log_ratio_sum = torch.clamp(masked_sum(log_ratio, response_mask, axis=-1), min=-20.0, max=20.0)
    metrics["chi2_seq"] = (torch.exp(2.0 * log_ratio_sum).mean() - 1.0).item()
    return metrics


def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """IS weights (when ``rollout_is`` is set) and mismatch metrics, prefixed ``rollout_corr/``.

    .. math:: \\ell = \\log\\pi_{old} - \\log\\pi_{rollout}, \\qquad w = \\mathrm{TIS}(\\ell)

    (see :func:`compute_rollout_correction_weights` and :func:`compute_offpolicy_metrics`).
    The metrics are computed even with ``rollout_is=None`` so the mismatch is visible before
    the correction is switched on.

    Args:
        old_log_prob: ``(bs, response_length)``.
        rollout_log_prob: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        rollout_is: ``None``, ``token`` or ``sequence`` (``algorithm.rollout_correction.rollout_is``).
        rollout_is_threshold: :math:`C` (``algorithm.rollout_correction.rollout_is_threshold``).
        rollout_is_batch_normalize: rescale weights to mean 1.

    Returns:
        rollout_is_weights: ``(bs, response_length)`` or ``None``.
        metrics: dict of floats.

    Raises:
        ValueError: shape mismatch, empty mask, unknown ``rollout_is``, non-positive threshold.
    """
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            "old_log_prob, rollout_log_prob and response_mask must have one shape; got "
            f"{tuple(old_log_prob.shape)}, {tuple(rollout_log_prob.shape)}, {tuple(response_mask.shape)}"
        )
    if rollout_is is not None:
        _check_level_and_threshold(rollout_is, rollout_is_threshold)
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            old_log_prob - rollout_log_prob,
            response_mask,
            rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, {f"rollout_corr/{key}": value for key, value in metrics.items()}
