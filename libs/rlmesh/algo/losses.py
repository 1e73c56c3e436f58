"""Loss aggregation, verl's policy losses (``policy_loss.loss_mode``), the value loss, the entropy bonus.

docs/algorithms.md#policy-loss-modes--actor_rollout_refactorpolicy_lossloss_mode"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import torch

from rlmesh.algo.logprobs import entropy_from_logits
from rlmesh.algo.masked import clip_by_value, masked_mean, masked_sum

__all__ = [
    "LOSS_AGG_MODES",
    "PG_METRICS",
    "POLICY_LOSS_REGISTRY",
    "GlobalBatchInfo",
    "PolicyLossInfo",
    "agg_loss",
    "compute_entropy_loss",
    "compute_pg_losses",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_value_loss",
    "get_policy_loss_fn",
    "policy_loss_info",
    "register_policy_loss",
]

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights, **knobs)
# -> (pg_loss, metrics): verl's signature with the config's knobs as keywords instead of `config`.
PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}

# The metrics verl's PPO-style losses report; a loss that reports fewer names its own.
PG_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


@dataclass(frozen=True)
class PolicyLossInfo:
    """What the learner needs to know about a registered loss besides calling it.

    Attributes:
        metrics: the metric names its second return value holds (the same for every input).
        loss_agg_mode: the aggregation it always uses whatever ``loss_agg_mode`` it is given
            (``None``: the given one); the learner's global normalisation follows it.
    """

    metrics: tuple[str, ...] = PG_METRICS
    loss_agg_mode: str | None = None


_POLICY_LOSS_INFO: dict[str, PolicyLossInfo] = {}


class GlobalBatchInfo(TypedDict, total=False):
    """verl's ``config.global_batch_info``: the global-batch counts passed on to :func:`agg_loss`."""

    dp_size: int
    batch_num_tokens: int | torch.Tensor | None
    global_batch_size: int | torch.Tensor | None
    loss_scale_factor: float | None


def register_policy_loss(
    name: str, *, metrics: tuple[str, ...] = PG_METRICS, loss_agg_mode: str | None = None
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy-loss function under ``name`` (see :class:`PolicyLossInfo`
    for ``metrics`` and ``loss_agg_mode``).

    Registering a different function under a taken name raises ``ValueError``.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"policy loss {name!r} is already registered to {existing.__qualname__}")
        POLICY_LOSS_REGISTRY[name] = fn
        _POLICY_LOSS_INFO[name] = PolicyLossInfo(metrics, loss_agg_mode)
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """Look up a registered policy loss (``vanilla`` is the PPO clipped surrogate).

    Raises:
        ValueError: unknown name; the message lists the registered ones.
    """
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; known policy losses: {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


def policy_loss_info(name: str) -> PolicyLossInfo:
    """The :class:`PolicyLossInfo` of a registered policy loss.

    Raises:
        ValueError: unknown name (as :func:`get_policy_loss_fn`).
    """
    get_policy_loss_fn(name)
    return _POLICY_LOSS_INFO[name]


def _nonzero_or_one(count: Any) -> Any:
    # An all-masked (micro-)batch gives loss 0 (sum 0 / 1) instead of verl's 0/0 = NaN; with at
    # least one valid element the division is unchanged.
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, count, torch.ones_like(count))
    return count if count > 0 else 1


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar, normalised over the global batch.

    Same signature and formulas as ``agg_loss`` in ``verl/trainer/ppo/core_algos.py`` of verl
    v0.9.0 (tag ``v0.9.0``, commit ``483b8a009ba3``; unchanged on main up to ``1dda039b9c63``).
    The loss of a micro-batch is its share of the global-batch loss, times ``dp_size`` (which the
    data-parallel gradient average divides out again), so summing the gradients of all
    micro-batches of all ranks gives the gradient of the global-batch loss.

    Shapes: ``loss_mat`` :math:`L` and ``loss_mask`` :math:`m` are ``(bs, T)``, ``bs`` the
    micro-batch's sequences and :math:`T` = ``response_length`` (the padded width). With

    - :math:`S_i = \\sum_t m_{i,t} L_{i,t}` the token-sum of sequence :math:`i` (``(bs,)``),
    - :math:`n_i = \\sum_t m_{i,t}` its valid tokens and :math:`s_i = [n_i > 0]`,
    - :math:`N` = ``batch_num_tokens``, valid tokens of the global batch
      (default :math:`\\sum_i n_i`, this micro-batch's),
    - :math:`B` = ``global_batch_size``, sequences of the global batch
      (default :math:`\\sum_i s_i`, this micro-batch's sequences with a valid token),
    - :math:`D` = ``dp_size`` and :math:`C` = ``loss_scale_factor`` (default :math:`T`):

    ===========================  ========================================================
    mode                         loss (a scalar)
    ===========================  ========================================================
    ``token-mean``               :math:`D \\cdot \\sum_i S_i / N`
    ``token-sum``                :math:`D \\cdot \\sum_i S_i`
    ``seq-mean-token-sum``       :math:`D \\cdot \\sum_i s_i S_i / B`
    ``seq-mean-token-mean``      :math:`D \\cdot \\sum_i s_i \\frac{S_i}{n_i + 10^{-8}} / B`
    ``seq-mean-token-sum-norm``  :math:`D \\cdot \\sum_i s_i S_i / (B \\cdot C)` (Dr.GRPO)
    ===========================  ========================================================

    ``seq-mean-token-sum-norm`` is ``seq-mean-token-sum`` divided by the constant :math:`C`
    (verl PR #5417; before it the sequence mean was missing and the loss was
    :math:`\\sum_i S_i / C`). Fully masked sequences add nothing and are not counted in the
    default :math:`B`.

    One deviation from verl: a zero count (an all-masked batch) gives loss 0 instead of
    ``0/0 = NaN``.

    Args:
        loss_mat: ``(bs, response_length)`` per-token loss.
        loss_mask: ``(bs, response_length)``.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        dp_size: data-parallel world size :math:`D`.
        batch_num_tokens: :math:`N` for ``token-mean``; required when ``dp_size > 1``.
        global_batch_size: :math:`B` for the ``seq-mean-*`` modes; required when ``dp_size > 1``.
        loss_scale_factor: :math:`C` for ``seq-mean-token-sum-norm``; default
            ``loss_mask.shape[-1]``. A constant (e.g. the maximum response length) keeps the
            normalisation the same for every batch.

    Returns:
        scalar tensor.

    Raises:
        ValueError: unknown ``loss_agg_mode``; ``dp_size > 1`` without the global count the
            mode needs (as in verl).
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("agg_loss: token-mean needs the global batch_num_tokens when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / _nonzero_or_one(batch_num_tokens) * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        seq_tokens = loss_mask.sum(dim=-1)
        seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)  # S_i, (bs,)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (seq_tokens + 1e-8)
        seq_mask = (seq_tokens > 0).to(seq_losses.dtype)  # fully masked sequences do not count
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(
                    f"agg_loss: {loss_agg_mode} needs the global global_batch_size when dp_size > 1"
                )
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / _nonzero_or_one(global_batch_size) * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            loss = loss / loss_scale_factor
        return loss
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; allowed: {list(LOSS_AGG_MODES)}")


def compute_pg_losses(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float,
    clip_ratio_c: float = 3.0,
) -> dict[str, torch.Tensor]:
    """Per-token PPO clipped surrogate with dual-clip, before masking and aggregation.

    .. math::
        \\rho = \\exp(\\mathrm{clamp}(\\log\\pi - \\log\\pi_{old}, -20, 20))

        L^{clip} = \\max(-A\\rho,\\; -A\\,\\mathrm{clip}(\\rho, 1-\\epsilon_{low}, 1+\\epsilon_{high}))

        L = \\begin{cases} \\min(L^{clip}, -A\\,c) & A < 0 \\\\ L^{clip} & A \\ge 0 \\end{cases}

    The dual clip (Ye et al. 2020) bounds the loss of a negative-advantage token by
    :math:`c\\,|A|` however large the ratio grows.

    Args:
        old_log_prob: ``(bs, response_length)``.
        log_prob: ``(bs, response_length)``.
        advantages: ``(bs, response_length)``.
        cliprange_low, cliprange_high: :math:`\\epsilon_{low}, \\epsilon_{high}`.
        clip_ratio_c: :math:`c > 1`.

    Returns:
        dict of ``(bs, response_length)`` tensors: ``pg_losses`` (the loss L),
        ``negative_approx_kl`` (the clamped log-ratio), ``is_clipped`` (the clipped branch is
        larger), ``is_clipped_lower`` (the dual clip binds).
    """
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    negative = advantages < 0
    return {
        "pg_losses": torch.where(negative, clip_pg_losses2, clip_pg_losses1),
        "negative_approx_kl": negative_approx_kl,
        "is_clipped": torch.gt(pg_losses2, pg_losses1),
        "is_clipped_lower": torch.gt(clip_pg_losses1, pg_losses3) & negative,
    }


def _clip_bounds(
    fn: str, cliprange: float | None, cliprange_low: float | None, cliprange_high: float | None
) -> tuple[float, float]:
    # verl: clip_ratio_low / clip_ratio_high default to clip_ratio.
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError(
            f"{fn} needs cliprange, or both cliprange_low and cliprange_high; "
            f"got cliprange={cliprange}, cliprange_low={cliprange_low}, cliprange_high={cliprange_high}"
        )
    return low, high


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped policy loss with asymmetric clip and dual-clip (Schulman et al. 2017).

    .. math::
        \\mathcal{L}_{pg} = \\mathrm{agg}\\big(w \\odot L(\\rho, A)\\big)

    with :math:`L` from :func:`compute_pg_losses` and :math:`w` the optional rollout
    importance weights (1 when absent). verl's older ``compute_policy_loss`` signature (four
    return values); the registry holds it as :func:`compute_policy_loss_vanilla`.

    Args:
        old_log_prob: ``(bs, response_length)`` log-probs of the policy that produced the data.
        log_prob: ``(bs, response_length)`` log-probs of the policy being trained.
        advantages: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        cliprange: symmetric clip :math:`\\epsilon` (``actor.clip_ratio``).
        cliprange_low: :math:`\\epsilon_{low}`, default ``cliprange`` (``actor.clip_ratio_low``).
        cliprange_high: :math:`\\epsilon_{high}`, default ``cliprange`` (``actor.clip_ratio_high``).
        clip_ratio_c: dual-clip bound :math:`c > 1` (``actor.clip_ratio_c``).
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: ``(bs, response_length)`` truncated IS weights, multiplied into the
            per-token losses before aggregation (treated as constants).
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: the global-batch
            normalisation, passed to :func:`agg_loss` (verl passes them as
            ``config.global_batch_info``); the defaults aggregate over this batch alone.

    Returns:
        pg_loss: scalar.
        pg_clipfrac: scalar, fraction of valid tokens where the clipped branch is taken.
        ppo_kl: scalar, :math:`\\mathrm{mean}(\\log\\pi_{old} - \\log\\pi)` over valid tokens.
        pg_clipfrac_lower: scalar, fraction of valid tokens where the dual clip binds.

    Raises:
        ValueError: ``clip_ratio_c <= 1`` or no clip range given.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1.0 for dual-clip PPO, got {clip_ratio_c}")
    cliprange_low, cliprange_high = _clip_bounds(
        "compute_policy_loss", cliprange, cliprange_low, cliprange_high
    )

    terms = compute_pg_losses(old_log_prob, log_prob, advantages, cliprange_low, cliprange_high, clip_ratio_c)
    ppo_kl = masked_mean(-terms["negative_approx_kl"], response_mask)
    pg_clipfrac = masked_mean(terms["is_clipped"].float(), response_mask)
    pg_clipfrac_lower = masked_mean(terms["is_clipped_lower"].float(), response_mask)

    pg_losses = terms["pg_losses"]
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    pg_loss = agg_loss(
        loss_mat=pg_losses,
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    # verl multiplies the per-token losses by the rollout IS weights, constants of the loss.
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights.detach()


def _zero(like: torch.Tensor) -> torch.Tensor:
    # A metric verl reports as a constant 0 for a loss that has no such event.
    return torch.zeros((), dtype=like.dtype, device=like.device)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``vanilla``: :func:`compute_policy_loss` in the registry's form (verl's
    ``compute_policy_loss_vanilla``), the same numbers.

    Shapes: every tensor argument ``(bs, response_length)``.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (scalars).
    """
    pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        cliprange=cliprange,
        cliprange_low=cliprange_low,
        cliprange_high=cliprange_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        **global_batch_info,
    )
    return pg_loss, {
        "actor/pg_clipfrac": pg_clipfrac,
        "actor/ppo_kl": ppo_kl,
        "actor/pg_clipfrac_lower": pg_clipfrac_lower,
    }


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO, group sequence policy optimisation (Zheng et al. 2025, arXiv 2507.18071): the PPO
    clip on a sequence-level ratio, the geometric mean of the token ratios.

    .. math::
        \\log s_i = \\frac{1}{\\max(n_i, 1)} \\sum_t m_{i,t} (\\log\\pi_{i,t} - \\log\\pi^{old}_{i,t})

        \\log s_{i,t} = \\min\\big(\\mathrm{sg}[\\log s_i] + \\log\\pi_{i,t} - \\mathrm{sg}[\\log\\pi_{i,t}],\\; 10\\big)

        L_{i,t} = \\max(-A_{i,t} s_{i,t},\\; -A_{i,t}\\,\\mathrm{clip}(s_{i,t}, 1-\\epsilon_{low}, 1+\\epsilon_{high}))

        \\mathcal{L} = \\mathrm{agg}(w \\odot L)

    :math:`s_{i,t}` equals :math:`s_i` in value; its gradient is :math:`s_i \\nabla\\log\\pi_{i,t}`
    (the stop-gradient token form of the paper's GSPO-token). The log-ratio is not clamped at
    ±20 (only :math:`\\log s_{i,t} \\le 10`), as in verl.

    ``loss_agg_mode`` is the actor's ``loss_agg_mode``, as in verl 0.9.1 (the paper and verl up
    to 0.7 always aggregate ``seq-mean-token-mean``; verl's GSPO examples set that mode).

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, response_length)``.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: ``(bs, response_length)``, multiplied into :math:`L` (:math:`w`).
        cliprange, cliprange_low, cliprange_high: :math:`\\epsilon`, as :func:`compute_policy_loss`.
        global_batch_info: passed to :func:`agg_loss`.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/pg_clipfrac`` (valid tokens whose clipped branch is the larger: whole
        sequences), ``actor/ppo_kl`` (:math:`\\mathrm{mean}(\\log\\pi_{old} - \\log\\pi)` over
        valid tokens), ``actor/pg_clipfrac_lower`` (0: no dual clip).
    """
    low, high = _clip_bounds("compute_policy_loss_gspo", cliprange, cliprange_low, cliprange_high)
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = response_mask.sum(dim=-1).clamp(min=1)
    log_seq_ratio = masked_sum(negative_approx_kl, response_mask, axis=-1) / seq_lengths  # (bs,)
    log_ratio = log_prob - log_prob.detach() + log_seq_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - low, 1 + high)
    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, {
        "actor/pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask),
        "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask),
        "actor/pg_clipfrac_lower": _zero(pg_loss),
    }


@register_policy_loss("sapo", loss_agg_mode="seq-mean-token-mean")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO, soft adaptive policy optimisation (arXiv 2511.20347): a sigmoid gate of the ratio
    in place of the hard clip.

    .. math::
        \\rho = \\exp(\\mathrm{clamp}(\\log\\pi - \\log\\pi_{old}, -20, 20)),\\quad
        \\tau = \\begin{cases}\\tau_{pos} & A > 0 \\\\ \\tau_{neg} & A \\le 0\\end{cases}

        L = -\\sigma(\\tau(\\rho - 1))\\,\\frac{4}{\\tau}\\,A,\\qquad
        \\mathcal{L} = \\mathrm{agg}_{\\text{seq-mean-token-mean}}(w \\odot L)

    The gate's slope at :math:`\\rho = 1` is 1, so on-policy its gradient is the vanilla one.
    Always aggregated ``seq-mean-token-mean``, whatever ``loss_agg_mode`` says (as in verl).

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, response_length)``.
        loss_agg_mode: ignored (see above).
        rollout_is_weights: ``(bs, response_length)``, multiplied into :math:`L`.
        tau_pos, tau_neg: the gate temperatures (``actor.tau_pos``, ``actor.tau_neg``).
        global_batch_info: passed to :func:`agg_loss`.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/ppo_kl`` (:math:`\\mathrm{mean}(-\\log\\rho)`); ``actor/pg_clipfrac``
        and ``actor/pg_clipfrac_lower`` are 0 (nothing is clipped).
    """
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(
        advantages > 0,
        torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = _weighted(-gates * advantages, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **global_batch_info)
    return pg_loss, {
        "actor/pg_clipfrac": _zero(pg_loss),
        "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask),
        "actor/pg_clipfrac_lower": _zero(pg_loss),
    }


@register_policy_loss("gpg", metrics=())
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG, group policy gradient (Chu et al. 2025, arXiv 2504.02546): plain REINFORCE, no ratio.

    .. math:: \\mathcal{L} = \\mathrm{agg}(-w \\odot A \\log\\pi)

    Args:
        old_log_prob: ``(bs, response_length)``, unused (kept for the registry's signature).
        log_prob, advantages, response_mask: ``(bs, response_length)``.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: ``(bs, response_length)`` :math:`w`.
        global_batch_info: passed to :func:`agg_loss`.

    Returns:
        pg_loss: scalar.
        metrics: none (verl reports none for gpg).
    """
    pg_losses = _weighted(-log_prob * advantages, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info), {}


@register_policy_loss("clip_cov", metrics=("actor/pg_clipfrac", "actor/ppo_kl"))
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv
    2505.22617): the PPO clip (no dual clip), plus the gradient of a few random tokens of high
    advantage-log-prob covariance cut off.

    .. math::
        \\rho = \\exp(\\log\\pi - \\log\\pi_{old}),\\quad
        L^{clip} = \\max(-A\\rho,\\; -A\\,\\mathrm{clip}(\\rho, 1-\\epsilon_{low}, 1+\\epsilon_{high}))

        c_{i,t} = (A_{i,t} - \\bar A)(\\log\\pi_{i,t} - \\overline{\\log\\pi})
        \\quad\\text{(means over the valid tokens)}

        \\mathcal{L} = \\mathrm{agg}(w \\odot L^{clip} \\odot (1 - z))

    :math:`z_{i,t} = 1` on :math:`k = \\max(\\lfloor r N \\rfloor, 1)` tokens (:math:`N` the
    valid tokens, :math:`r` = ``clip_cov_ratio``) drawn uniformly without replacement from the
    candidates: valid tokens not clipped by the ratio with :math:`lb < c_{i,t} < ub`. verl draws
    them with ``torch.randperm`` over the candidates in row-major order and takes the first
    :math:`k`; so does this function, with ``generator`` (``None``: torch's global generator, as
    verl). The log-ratio is not clamped, as in verl.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, response_length)``.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: ``(bs, response_length)`` :math:`w`.
        cliprange, cliprange_low, cliprange_high: :math:`\\epsilon`, as :func:`compute_policy_loss`.
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: :math:`r`, :math:`lb`, :math:`ub`
            (``policy_loss.clip_cov_*``); ``clip_cov_ratio > 0``.
        generator: the random draw's generator (a CPU one).
        global_batch_info: passed to :func:`agg_loss`.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/pg_clipfrac`` (valid tokens cut off, :math:`\\mathrm{mean}(z)`; not the
        ratio-clipped ones), ``actor/ppo_kl`` (:math:`\\mathrm{mean}(-\\log\\rho)`).

    Raises:
        ValueError: ``clip_cov_ratio <= 0``.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    low, high = _clip_bounds("compute_policy_loss_clip_cov", cliprange, cliprange_low, cliprange_high)
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)

    valid = response_mask.bool()
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob, response_mask)
        )
        candidates = valid & ~torch.gt(pg_losses2, pg_losses1) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        positions = torch.nonzero(candidates)  # (n, 2), row-major as verl's
        clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
        corr = torch.ones_like(advantages)
        if len(positions) > 0:
            perm = torch.randperm(len(positions), generator=generator).to(positions.device)
            chosen = positions[perm[:clip_num]]
            corr[chosen[:, 0], chosen[:, 1]] = 0

    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2) * corr, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, {
        "actor/pg_clipfrac": masked_mean((corr == 0).float(), response_mask),
        "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask),
    }


@register_policy_loss("kl_cov", metrics=("actor/ppo_kl",))
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped policy gradient, plus a
    :math:`|\\log\\rho|` penalty on the tokens of largest advantage-log-prob covariance.

    .. math::
        \\rho = \\exp(\\log\\pi - \\log\\pi_{old}),\\quad
        c_{i,t} = (A_{i,t} - \\bar A)(\\log\\pi_{i,t} - \\overline{\\log\\pi})

        L_{i,t} = -A_{i,t}\\rho_{i,t} + \\beta\\,|\\log\\rho_{i,t}|\\,[\\,(i,t) \\in \\mathrm{top}_k(c)\\,]

        \\mathcal{L} = \\mathrm{agg}(w \\odot L)

    Means and the top :math:`k = \\max(\\lfloor r N \\rfloor, 1)` are over the :math:`N` valid
    tokens (:math:`r` = ``kl_cov_ratio``, :math:`\\beta` = ``ppo_kl_coef``); deterministic. No
    clip, no clamp of the log-ratio, as in verl.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, response_length)``.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: ``(bs, response_length)`` :math:`w`.
        kl_cov_ratio, ppo_kl_coef: :math:`r > 0`, :math:`\\beta` (``policy_loss.*``).
        global_batch_info: passed to :func:`agg_loss`.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/ppo_kl``, here verl's :math:`\\mathrm{mean}(|\\log\\rho|)` over valid
        tokens (an absolute value, unlike the other losses' signed mean).

    Raises:
        ValueError: ``kl_cov_ratio <= 0``.
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    pg_losses1 = -advantages * torch.exp(negative_approx_kl)

    valid_flat = torch.nonzero(response_mask.reshape(-1) > 0, as_tuple=True)[0]  # (N,)
    penalised = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
    if len(valid_flat) > 0:
        with torch.no_grad():
            adv = advantages.reshape(-1)[valid_flat]
            logp = log_prob.detach().reshape(-1)[valid_flat]
            cov = (adv - adv.mean()) * (logp - logp.mean())
            k = max(1, int(len(cov) * kl_cov_ratio))
            penalised[valid_flat[torch.topk(cov, k, largest=True).indices]] = True
    pg_losses = torch.where(penalised.view_as(advantages), pg_losses1 + ppo_kl_coef * abs_kl, pg_losses1)
    pg_losses = _weighted(pg_losses, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, {"actor/ppo_kl": masked_mean(abs_kl, response_mask)}


@register_policy_loss("geo_mean", loss_agg_mode="seq-mean-token-mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv 2507.20673): the
    sequence's ratio is the geometric mean of its token ratios, each clipped in log space.

    .. math::
        \\ell_{i,t} = \\log\\pi_{i,t} - \\log\\pi^{old}_{i,t},\\quad
        \\hat\\ell_{i,t} = \\mathrm{sgn}(A_{i,t}) \\min\\big(\\mathrm{sgn}(A_{i,t})\\,\\ell_{i,t},\\;
        \\mathrm{sgn}(A_{i,t})\\,\\mathrm{clip}(\\ell_{i,t}, -\\epsilon_{low}, \\epsilon_{high})\\big)

        r_i = \\exp\\Big(\\frac{\\sum_t m_{i,t}\\hat\\ell_{i,t}}{n_i + 10^{-8}}\\Big),\\quad
        \\bar A_i = \\frac{\\sum_t m_{i,t} A_{i,t}}{n_i + 10^{-8}},\\quad
        \\bar w_i = \\exp\\Big(\\frac{\\sum_t m_{i,t}\\log(w_{i,t} + 10^{-10})}{n_i + 10^{-8}}\\Big)

        \\mathcal{L} = D \\cdot \\sum_i s_i\\,(-\\bar A_i r_i \\bar w_i) / B

    :math:`\\epsilon` bounds the log-ratio (verl's "clipping wider"). The loss is a mean over
    sequences: :math:`s_i = [n_i > 0]`, :math:`B` = ``global_batch_size`` (default
    :math:`\\sum_i s_i`), :math:`D` = ``dp_size``; ``loss_agg_mode`` is ignored. verl 0.9.1 takes
    ``torch.mean`` over the micro-batch's rows without the global counts; this is the same on a
    batch without empty rows, normalised over the global batch like the ``seq-mean-*`` modes
    (as verl up to 0.7, whose actor weighted each micro-batch's mean by its rows).

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, response_length)``.
        loss_agg_mode: ignored (see above).
        rollout_is_weights: ``(bs, response_length)`` :math:`w`, applied per sequence as their
            geometric mean :math:`\\bar w_i`.
        cliprange, cliprange_low, cliprange_high: :math:`\\epsilon`, as :func:`compute_policy_loss`.
        global_batch_info: ``dp_size`` and ``global_batch_size`` are used.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/pg_clipfrac`` / ``actor/pg_clipfrac_lower`` (valid tokens whose
        log-ratio is clipped with :math:`A > 0` / :math:`A < 0`), ``actor/ppo_kl``
        (:math:`\\mathrm{mean}(-\\ell)`).
    """
    low, high = _clip_bounds("compute_policy_loss_geo_mean", cliprange, cliprange_low, cliprange_high)
    negative_approx_kl = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(negative_approx_kl, -low, high)
    clipped_log_ratio = sign * torch.min(sign * negative_approx_kl, sign * clamped)
    seq_tokens = response_mask.sum(dim=-1)
    denominator = seq_tokens + 1e-8
    seq_ratio = torch.exp(masked_sum(clipped_log_ratio, response_mask, axis=-1) / denominator)
    seq_advantage = masked_sum(advantages, response_mask, axis=-1) / denominator
    seq_losses = -seq_advantage * seq_ratio  # (bs,)
    if rollout_is_weights is not None:
        log_weights = torch.log(rollout_is_weights.detach() + 1e-10)
        seq_losses = seq_losses * torch.exp(masked_sum(log_weights, response_mask, axis=-1) / denominator)

    seq_mask = (seq_tokens > 0).to(seq_losses.dtype)
    dp_size = global_batch_info.get("dp_size", 1)
    global_batch_size = global_batch_info.get("global_batch_size")
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(
                "compute_policy_loss_geo_mean needs the global global_batch_size when dp_size > 1"
            )
        global_batch_size = seq_mask.sum()
    pg_loss = masked_sum(seq_losses, seq_mask) / _nonzero_or_one(global_batch_size) * dp_size

    clipped = torch.ne(negative_approx_kl, clamped)
    return pg_loss, {
        "actor/pg_clipfrac": masked_mean((clipped & (advantages > 0)).float(), response_mask),
        "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask),
        "actor/pg_clipfrac_lower": masked_mean((clipped & (advantages < 0)).float(), response_mask),
    }


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, arXiv 2506.13585): REINFORCE
    weighted by the clipped ratio, the weight a constant, so no token's gradient is dropped.

    .. math::
        \\rho = \\exp(\\mathrm{clamp}(\\log\\pi - \\log\\pi_{old}, -20, 20))

        L = -\\mathrm{sg}[\\mathrm{clip}(\\rho, 1-\\epsilon_{low}, 1+\\epsilon_{high})]\\,A\\,\\log\\pi,
        \\qquad \\mathcal{L} = \\mathrm{agg}(w \\odot L)

    Gradient: :math:`-\\mathrm{clip}(\\rho)\\,A\\,\\nabla\\log\\pi` on every token.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, response_length)``.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: ``(bs, response_length)`` :math:`w`.
        cliprange, cliprange_low, cliprange_high: :math:`\\epsilon`, as :func:`compute_policy_loss`.
        global_batch_info: passed to :func:`agg_loss`.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/pg_clipfrac`` (valid tokens whose ratio the clip changes, either side),
        ``actor/ppo_kl`` (:math:`\\mathrm{mean}(-\\log\\rho)`), ``actor/pg_clipfrac_lower`` (0).
    """
    low, high = _clip_bounds("compute_policy_loss_cispo", cliprange, cliprange_low, cliprange_high)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = _weighted(-clipped_ratio.detach() * advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, {
        "actor/pg_clipfrac": masked_mean(torch.ne(ratio, clipped_ratio).float(), response_mask),
        "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask),
        "actor/pg_clipfrac_lower": _zero(pg_loss),
    }


def _dppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
    clip_ratio_c: float,
    trusted: torch.Tensor,
    global_batch_info: GlobalBatchInfo,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # The part DPPO-TV and DPPO-KL share, given the tokens inside the trust region.
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    valid = trusted.detach().to(log_prob.dtype)
    pg_losses = _weighted(-advantages * truncated_ratio * log_prob * valid, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, {
        "actor/pg_clipfrac": masked_mean(1.0 - valid, response_mask),
        "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask),
        "actor/pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).to(valid.dtype) * valid, response_mask),
    }


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 20.0,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (arXiv 2602.04879): REINFORCE with a truncated IS weight, masked outside a
    total-variation trust region on the sampled token's probability.

    .. math::
        \\rho = \\exp(\\mathrm{clamp}(\\log\\pi - \\log\\pi_{old}, -20, 20)),\\quad
        v = \\begin{cases} [\\pi - \\pi_{old} \\le \\delta_{high}] & A > 0 \\\\
                           [\\pi - \\pi_{old} \\ge -\\delta_{low}] & A \\le 0 \\end{cases}

        L = -A\\,\\mathrm{sg}[\\min(\\rho, c)]\\,\\log\\pi\\;\\mathrm{sg}[v],\\qquad
        \\mathcal{L} = \\mathrm{agg}(w \\odot L)

    :math:`\\delta` is the clip range (``actor.clip_ratio*``, here a probability distance) and
    :math:`c` = ``clip_ratio_c`` (verl reads ``actor.clip_ratio_c``, default 3).

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, response_length)``.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: ``(bs, response_length)`` :math:`w`.
        cliprange, cliprange_low, cliprange_high: :math:`\\delta`, as :func:`compute_policy_loss`.
        clip_ratio_c: the IS truncation :math:`c`.
        global_batch_info: passed to :func:`agg_loss`.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/pg_clipfrac`` (:math:`\\mathrm{mean}(1 - v)`), ``actor/ppo_kl``
        (:math:`\\mathrm{mean}(-\\log\\rho)`), ``actor/pg_clipfrac_lower``
        (:math:`\\mathrm{mean}([\\rho > c]\\,v)`), means over valid tokens.
    """
    low, high = _clip_bounds("compute_policy_loss_dppo_tv", cliprange, cliprange_low, cliprange_high)
    change = torch.exp(log_prob) - torch.exp(old_log_prob)
    trusted = torch.where(advantages > 0, change <= high, change >= -low)
    return _dppo(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
        clip_ratio_c, trusted, global_batch_info,
    )  # fmt: skip


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 20.0,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (arXiv 2602.04879): :func:`compute_policy_loss_dppo_tv` with the trust
    region measured by the KL divergence of the binary (sampled token / any other) distributions.

    .. math::
        D = \\pi_{old}(\\log\\pi_{old} - \\log\\pi)
            + (1 - \\pi_{old}) \\log\\frac{1 - \\pi_{old} + 10^{-8}}{1 - \\pi + 10^{-8}}

        v = \\begin{cases} [D \\le \\delta_{high}] \\lor [\\pi \\le \\pi_{old}] & A > 0 \\\\
                           [D \\le \\delta_{low}] \\lor [\\pi \\ge \\pi_{old}] & A \\le 0 \\end{cases}

    and :math:`L`, :math:`\\mathcal{L}`, the arguments and metrics as DPPO-TV's.
    """
    low, high = _clip_bounds("compute_policy_loss_dppo_kl", cliprange, cliprange_low, cliprange_high)
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    trusted = torch.where(
        advantages > 0, (binary_kl <= high) | (prob <= old_prob), (binary_kl <= low) | (prob >= old_prob)
    )
    return _dppo(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
        clip_ratio_c, trusted, global_batch_info,
    )  # fmt: skip


@register_policy_loss("dro", metrics=("actor/ppo_kl",))
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    dro_beta: float | None = None,
    **global_batch_info: Unpack[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO, direct reward optimisation (Richemond et al. 2025, arXiv 2405.19107): REINFORCE with
    a quadratic penalty on the log-ratio.

    .. math::
        L = -\\big(A\\log\\pi - \\tfrac{\\beta}{2}(\\log\\pi - \\log\\pi_{old})^2\\big),
        \\qquad \\mathcal{L} = \\mathrm{agg}(w \\odot L)

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, response_length)``.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: ``(bs, response_length)`` :math:`w`.
        dro_beta: :math:`\\beta > 0` (``policy_loss.dro_beta``).
        global_batch_info: passed to :func:`agg_loss`.

    Returns:
        pg_loss: scalar.
        metrics: ``actor/ppo_kl`` (:math:`\\mathrm{mean}(\\log\\pi_{old} - \\log\\pi)`).

    Raises:
        ValueError: ``dro_beta`` missing or not positive.
    """
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(f"policy_loss.dro_beta must be a positive value when using DRO, got {dro_beta}")
    log_ratio = log_prob - old_log_prob
    pg_losses = _weighted(-(log_prob * advantages - 0.5 * dro_beta * log_ratio.square()), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, {"actor/ppo_kl": masked_mean(-log_ratio, response_mask)}


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss.

    .. math::
        V^{clip} = \\mathrm{clip}(V_\\theta, V_{old} - \\epsilon_v, V_{old} + \\epsilon_v)

        \\mathcal{L}_{v} = \\tfrac12\\,\\mathrm{agg}\\big(\\max((V_\\theta - R)^2, (V^{clip} - R)^2)\\big)

    Args:
        vpreds: ``(bs, response_length)`` values predicted by the critic being trained.
        returns: ``(bs, response_length)`` regression targets.
        values: ``(bs, response_length)`` values of the critic that scored the rollout.
        response_mask: ``(bs, response_length)``.
        cliprange_value: :math:`\\epsilon_v` (``critic.cliprange_value``).
        loss_agg_mode: see :func:`agg_loss`.
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: the global-batch
            normalisation, passed to :func:`agg_loss` (as verl's ``compute_value_loss`` does).

    Returns:
        vf_loss: scalar.
        vf_clipfrac: scalar, fraction of valid tokens where the clipped error is the larger.
    """
    vpredclipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(
        loss_mat=clipped_vf_losses,
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregated token entropy (subtracted from the policy loss times ``actor.entropy_coeff``).

    .. math:: \\mathcal{H} = \\mathrm{agg}(H(\\mathrm{softmax}(z_t)))

    Args:
        logits: ``(bs, response_length, vocab_size)``.
        response_mask: ``(bs, response_length)``.
        loss_agg_mode: see :func:`agg_loss`.
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: the global-batch
            normalisation, passed to :func:`agg_loss`.

    Returns:
        scalar tensor.
    """
    token_entropy = entropy_from_logits(logits)
    return agg_loss(
        loss_mat=token_entropy,
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
