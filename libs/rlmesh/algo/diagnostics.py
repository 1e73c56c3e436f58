"""Diagnostics the learner logs every step: clip fraction, approximate KL, batch statistics.

docs/algorithms.md#log-probabilities-and-metrics"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np
import torch

from rlmesh.algo.kl import kl_penalty
from rlmesh.algo.masked import masked_mean

__all__ = [
    "bootstrap_metric",
    "compute_approx_kl",
    "compute_clipfrac",
    "compute_data_metrics",
    "masked_stats",
    "process_validation_metrics",
]


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


def bootstrap_metric(
    data: Sequence[float],
    subset_size: int,
    reduce_fns: Sequence[Callable[[np.ndarray], float]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """verl's ``bootstrap_metric``: the mean and std (ddof 0) over ``n_bootstrap`` draws of
    ``subset_size`` values with replacement of each ``reduce_fn`` of the draw; the draws are verl's
    (``np.random.seed(seed)`` then one ``choice``), from a generator of their own here.

    .. math:: \\left(\\overline{f(x_{I_b})},\\ \\mathrm{std}_b\\, f(x_{I_b})\\right),
        \\qquad I_b \\sim \\mathcal{U}\\{1..n\\}^{k}
    """
    idx = _bootstrap_indices(len(data), subset_size, n_bootstrap, seed)
    draws = np.asarray(data, dtype=np.float64)[idx]
    out = []
    for fn in reduce_fns:
        results = np.array([fn(row) for row in draws], dtype=np.float64)
        out.append((float(np.mean(results)), float(np.std(results))))
    return out


def _bootstrap_indices(n_data: int, subset_size: int, n_bootstrap: int, seed: int) -> np.ndarray:
    # What verl's np.random.seed(seed); np.random.choice(...) draws, without touching the global RNG.
    return np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, subset_size), replace=True)


def _bootstrap_sizes(n_resps: int) -> list[int]:
    """verl's subset sizes for ``best@n``/``worst@n``: 2, 4, 8, ... below ``n_resps``, then ``n_resps``."""
    if n_resps <= 1:
        return []
    sizes, n = [], 2
    while n < n_resps:
        sizes.append(n)
        n *= 2
    return [*sizes, n_resps]


def _per_prompt_metrics(values: np.ndarray, seed: int, n_bootstrap: int) -> dict[str, np.ndarray]:
    """verl's per-prompt statistics of ``values`` ``(prompts, n)`` (every prompt with ``n`` samples),
    one entry per prompt: ``mean@n``, and with ``n > 1`` ``std@n`` and the bootstrapped
    ``best@k/{mean,std}``, ``worst@k/{mean,std}``."""
    n = values.shape[1]
    out = {f"mean@{n}": values.mean(axis=1)}
    if n > 1:
        out[f"std@{n}"] = values.std(axis=1)
        for k in _bootstrap_sizes(n):
            idx = _bootstrap_indices(n, k, n_bootstrap, seed)
            best, worst = [], []
            for start in range(0, len(values), 64):  # (64, n_bootstrap, k) at a time
                draws = values[start : start + 64][:, idx]
                best.append(draws.max(axis=2))
                worst.append(draws.min(axis=2))
            for name, results in (("best", np.concatenate(best)), ("worst", np.concatenate(worst))):
                out[f"{name}@{k}/mean"] = results.mean(axis=1)
                out[f"{name}@{k}/std"] = results.std(axis=1)
    return out


def process_validation_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence[Hashable],
    infos_dict: Mapping[str, Sequence[float]],
    seed: int = 42,
    n_bootstrap: int = 1000,
) -> dict[str, dict[str, dict[str, float]]]:
    """verl's ``process_validation_metrics`` (``metric_utils.py``) on numbers:
    ``{data_source: {variable: {metric: value}}}``.

    The samples of one prompt share a uid. For each data source, variable (a key of
    ``infos_dict``: ``reward``, and a reward function's extra values) and prompt: ``mean@n`` and,
    with ``n > 1`` samples, ``std@n`` (ddof 0), ``best@k/{mean,std}`` and ``worst@k/{mean,std}``
    for ``k`` = 2, 4, ... and ``n`` (:func:`bootstrap_metric` of max / min); each then averaged
    over the prompts that have it. A NaN value (the sample lacks the variable) is left out, so a
    prompt may count fewer samples for one variable; verl requires every sample to have every
    variable. ``maj@k`` needs verl's string ``pred`` variable, which numbers cannot carry: not
    computed.
    """
    grouped: dict[str, dict[str, dict[Hashable, list[float]]]] = defaultdict(lambda: defaultdict(dict))
    for var, values in infos_dict.items():
        if len(values) != len(data_sources) or len(sample_uids) != len(data_sources):
            raise ValueError(
                f"{var}: {len(values)} values for {len(data_sources)} data sources and {len(sample_uids)} uids"
            )
        for source, uid, value in zip(data_sources, sample_uids, values, strict=True):
            if not math.isnan(value):
                grouped[source][var].setdefault(uid, []).append(float(value))
    result: dict[str, dict[str, dict[str, float]]] = {}
    for source, variables in grouped.items():
        for var, by_uid in variables.items():
            by_count: dict[int, list[list[float]]] = defaultdict(list)
            for vals in by_uid.values():
                by_count[len(vals)].append(vals)
            per_prompt: dict[str, list[np.ndarray]] = defaultdict(list)
            for rows in by_count.values():
                for name, values in _per_prompt_metrics(np.array(rows), seed, n_bootstrap).items():
                    per_prompt[name].append(values)
            result.setdefault(source, {})[var] = {
                name: float(np.mean(np.concatenate(parts))) for name, parts in per_prompt.items()
            }
    return result
