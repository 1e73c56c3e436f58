"""Masked reductions over the valid tokens of a padded batch: padding never touches a result.

docs/algorithms.md#masked-statistics"""

from __future__ import annotations

import torch

__all__ = ["clip_by_value", "masked_mean", "masked_sum", "masked_var", "masked_whiten"]


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of the valid entries.

    .. math:: S = \\sum_i m_i x_i

    Args:
        values: any shape, e.g. ``(bs, response_length)``.
        mask: same shape as ``values``.
        axis: dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``values`` reduced over ``axis``.
    """
    # NaN * 0 is NaN, so masked entries must be zeroed before the product with the mask.
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (valid * mask).sum(dim=axis)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of the valid entries.

    .. math:: \\bar{x} = \\frac{\\sum_i m_i x_i}{\\sum_i m_i + 10^{-8}}

    The 1e-8 (as in verl) makes an all-masked reduction return 0 instead of NaN.

    Args:
        values: any shape, e.g. ``(bs, response_length)``.
        mask: same shape as ``values``.
        axis: dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``values`` reduced over ``axis``.
    """
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries (over all dimensions), with Bessel's correction by default.

    .. math::
        \\sigma^2 = \\overline{(x - \\bar{x})^2} \\cdot \\frac{N}{N - 1},\\quad N = \\sum_i m_i

    Args:
        values: any shape, e.g. ``(bs, response_length)``.
        mask: same shape as ``values``.
        unbiased: apply the ``N / (N - 1)`` correction.

    Returns:
        scalar tensor.

    Raises:
        ValueError: with ``unbiased=True`` when fewer than two entries are valid.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError(
                "masked_var: the mask selects no element; at least two are needed (unbiased=True)."
            )
        if count == 1:
            raise ValueError(
                "masked_var: the mask selects one element; the unbiased variance divides by N - 1 = 0. "
                "Use a larger (mini-)batch."
            )
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to zero mean and unit variance using statistics of the valid entries only.

    .. math::
        \\hat{x} = \\frac{x - \\bar{x}}{\\sqrt{\\sigma^2 + 10^{-8}}} \\; (+\\, \\bar{x} \\text{ if not shift\\_mean})

    with :math:`\\bar{x}` = ``masked_mean`` and :math:`\\sigma^2` = unbiased ``masked_var``.

    Args:
        values: any shape, e.g. ``(bs, response_length)``.
        mask: same shape as ``values``.
        shift_mean: if False the original mean is added back after scaling.

    Returns:
        same shape as ``values``. Entries at masked positions are transformed too (they are
        not zeroed); callers multiply by the mask where that matters.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Element-wise clip with tensor bounds.

    .. math:: \\mathrm{clip}(x) = \\max(\\min(x, x_{max}), x_{min})

    Args:
        x: any shape.
        tensor_min, tensor_max: broadcastable to ``x``.

    Returns:
        same shape as ``x``.
    """
    return torch.max(torch.min(x, tensor_max), tensor_min)
