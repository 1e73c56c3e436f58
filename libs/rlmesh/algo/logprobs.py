"""Per-token log-probabilities and entropies from logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["entropy_from_logits", "logprobs_from_logits", "logprobs_from_logits_naive"]


class _ChunkedLabelLogProbs(torch.autograd.Function):
    """``z[y] - logsumexp(z)`` row-chunk by row-chunk, forward and backward.

    Backward writes ``d/dz = g * (onehot(y) - softmax(z))`` chunk by chunk into one gradient
    buffer, so neither pass holds more than one vocabulary-sized tensor plus one chunk.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:  # type: ignore[override]
        # logsumexp in half precision loses too much; each chunk is reduced in fp32 instead, the
        # way log_softmax accumulates internally.
        compute_dtype = torch.float32 if logits.dtype in (torch.bfloat16, torch.float16) else logits.dtype
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(compute_dtype)
        log_partition = torch.cat(
            [torch.logsumexp(chunk.to(compute_dtype), dim=-1) for chunk in logits.split(chunk_size, dim=0)]
        )
        ctx.save_for_backward(logits, labels, log_partition)
        ctx.chunk_size = chunk_size
        return (picked - log_partition).to(logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        logits, labels, log_partition = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        grad_logits = torch.empty_like(logits)
        grad_f = grad_out.to(log_partition.dtype)
        for start in range(0, logits.shape[0], chunk_size):
            stop = min(start + chunk_size, logits.shape[0])
            probs = (logits[start:stop].to(log_partition.dtype) - log_partition[start:stop, None]).exp_()
            grad_logits[start:stop] = probs.mul_(-grad_f[start:stop, None])
        grad_logits.scatter_add_(-1, labels.unsqueeze(-1), grad_out.unsqueeze(-1).to(grad_logits.dtype))
        return grad_logits, None, None


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """Log-probability of each label under the softmax of its logits.

    .. math:: \\log p(y_t) = z_{t, y_t} - \\log \\sum_v e^{z_{t, v}}

    The label logit is gathered first and the log-partition is computed by ``logsumexp`` over
    row chunks, so no second full-vocabulary tensor (the ``log_softmax`` output) is ever built:
    forward temporaries are bounded by one chunk and nothing vocabulary-sized is saved for
    backward except ``logits`` itself. The backward fills one gradient buffer chunk by chunk.

    Args:
        logits: ``(..., vocab_size)``, e.g. ``(bs, response_length, vocab_size)``.
        labels: ``(...)`` integer token ids, e.g. ``(bs, response_length)``.
        chunk_size: rows of the flattened ``(N, vocab_size)`` view per chunk; by default about
            16M elements per chunk (64 MiB of fp32 temporaries) whatever the vocabulary size.

    Returns:
        ``(...)`` log-probabilities in the dtype of ``logits`` (bf16/fp16 chunks are reduced in
        fp32, as ``log_softmax`` does internally, then rounded back).
    """
    vocab_size = logits.shape[-1]
    batch_shape = logits.shape[:-1]
    if chunk_size is None:
        chunk_size = max(1, (1 << 24) // max(vocab_size, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    flat_logits = logits.reshape(-1, vocab_size)
    flat_labels = labels.reshape(-1).to(torch.long)
    out = _ChunkedLabelLogProbs.apply(flat_logits, flat_labels, chunk_size)
    return out.view(batch_shape)


def logprobs_from_logits_naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference implementation: ``log_softmax`` over the whole vocabulary, then gather.

    .. math:: \\log p(y_t) = \\mathrm{log\\_softmax}(z_t)_{y_t}

    Materialises a second ``(..., vocab_size)`` tensor; kept for tests and benchmarks.

    Args:
        logits: ``(..., vocab_size)``.
        labels: ``(...)`` integer token ids.

    Returns:
        ``(...)`` log-probabilities.
    """
    return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1).to(torch.long)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by each row of logits.

    .. math:: H = \\log \\sum_v e^{z_v} - \\sum_v \\mathrm{softmax}(z)_v \\, z_v

    Args:
        logits: ``(..., vocab_size)``, e.g. ``(bs, response_length, vocab_size)``.

    Returns:
        ``(...)`` entropies, e.g. ``(bs, response_length)``.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)
