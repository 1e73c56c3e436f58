"""Loss aggregation, the PPO clipped policy loss, the clipped value loss and the entropy bonus.

docs/algorithms.md#policy-loss--actor_rollout_refactor"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlmesh.algo.logprobs import entropy_from_logits
from rlmesh.algo.masked import clip_by_value, masked_mean, masked_sum

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "agg_loss",
    "compute_entropy_loss",
    "compute_pg_losses",
    "compute_policy_loss",
    "compute_value_loss",
    "get_policy_loss_fn",
    "register_policy_loss",
]

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

PolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]

POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy-loss function under ``name``.

    Registering a different function under a taken name raises ``ValueError``.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"policy loss {name!r} is already registered to {existing.__qualname__}")
        POLICY_LOSS_REGISTRY[name] = fn
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


@register_policy_loss("vanilla")
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
    importance weights (1 when absent).

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
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    if cliprange_low is None or cliprange_high is None:
        raise ValueError(
            "compute_policy_loss needs cliprange, or both cliprange_low and cliprange_high; "
            f"got cliprange={cliprange}, cliprange_low={cliprange_low}, cliprange_high={cliprange_high}"
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
