"""Data-parallel pieces shared by the actor and the critic: global loss scaling, metric sums over
ranks, this rank's micro-batches, and forward passes without grad over a sharded batch."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlmesh.learner.dist import all_reduce_sum, rank, world_size
from rlmesh.learner.ppo.batch import PPOBatch
from rlmesh.learner.ppo.forward import MicroBatch, pad_to_width, slice_micro_batch
from rlmesh.learner.ppo.partition import plan_micro_batches

__all__ = ["MetricSums", "forward_without_grad", "global_loss_scale", "micro_batch_plan", "mini_batch_counts"]


class MetricSums:
    """Metric sums of one rank, summed over the ranks in one all-reduce at the end."""

    def __init__(self) -> None:
        self.values: dict[str, float] = defaultdict(float)

    def add(self, key: str, value: float) -> None:
        self.values[key] += float(value)

    def reduced(self) -> dict[str, float]:
        keys = sorted(self.values)  # every rank ran the same plan, so holds the same keys
        totals = all_reduce_sum(torch.tensor([self.values[k] for k in keys], dtype=torch.float64))
        return dict(zip(keys, totals.tolist(), strict=True))


def global_loss_scale(
    response_mask: torch.Tensor, loss_agg_mode: str, n_tokens: int, n_seqs: int, dp_size: int, norm_len: int
) -> float:
    """Factor turning a micro-batch loss aggregated over itself into its share of the global
    mini-batch loss, times ``dp_size`` (which DeepSpeed's gradient averaging divides out).

    ``agg_loss`` of a micro-batch divides by its own count ``c`` (valid tokens for token-mean,
    sequences for seq-mean-*, the padded width for seq-mean-token-sum-norm):

    .. math:: \\mathcal{L}_{micro} \\cdot \\frac{c}{C_{global}} \\cdot dp
              = \\mathrm{agg\\_loss}(\\ldots, dp\\_size, batch\\_num\\_tokens, global\\_batch\\_size)

    which is verl's global normalisation; -norm divides by ``n_seqs · norm_len`` (the non-empty
    sequences of the global mini-batch times a constant length) instead of each micro-batch's own
    sequence count times its padded width.
    """
    if loss_agg_mode == "token-mean":
        local, total = float(response_mask.sum()), float(n_tokens)
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        local, total = float((response_mask.sum(dim=-1) > 0).sum()), float(n_seqs)
    else:  # seq-mean-token-sum-norm: seq-mean-token-sum over the constant length norm_len
        local = float((response_mask.sum(dim=-1) > 0).sum()) * float(response_mask.shape[-1])
        total = float(n_seqs) * float(norm_len)
    return local / max(total, 1.0) * dp_size


def mini_batch_counts(batch: PPOBatch, rows: Sequence[int]) -> tuple[int, int]:
    """Valid response tokens and sequences with at least one of them, over the global mini-batch."""
    mask = batch.response_mask[list(rows)]
    return int(mask.sum()), int((mask.sum(dim=-1) > 0).sum())


def micro_batch_plan(
    batch: PPOBatch,
    rows: Sequence[int],
    micro_batch_size: int | None,
    use_dynamic_bsz: bool | None,
    max_token_len: int | None,
    balance: bool = True,
) -> list[list[int]]:
    """This rank's micro-batches of ``rows`` (see :func:`rlmesh.learner.ppo.partition.plan_micro_batches`);
    ``balance``: ``trainer.balance_batch``, the ranks' shares even in tokens."""
    return plan_micro_batches(
        rows,
        world_size(),
        rank(),
        micro_batch_size=micro_batch_size,
        use_dynamic_bsz=bool(use_dynamic_bsz),
        max_token_len=max_token_len,
        seq_lens=batch.attention_mask.sum(dim=1).tolist(),
        balance=balance,
    )


def forward_without_grad(
    engine: Any,
    batch: PPOBatch,
    fn: Callable[[MicroBatch], tuple[torch.Tensor, ...]],
    num_outputs: int,
    plan: list[list[int]],
    device: torch.device,
) -> list[torch.Tensor]:
    """Run ``fn`` (``(n, w)`` tensors per micro-batch) over this rank's ``plan`` in eval mode
    without grad; results go into full ``(bs, R)`` tensors summed over the ranks (each row is
    computed by exactly one rank, the others hold zeros there)."""
    zero3 = engine.zero_optimization_stage() == 3
    outputs = [torch.zeros(len(batch), batch.response_length) for _ in range(num_outputs)]
    engine.eval()
    with torch.no_grad():
        for rows in plan:
            if not rows:
                if zero3:  # ZeRO-3 forwards gather parameters collectively: stay in step
                    fn(slice_micro_batch(batch, [0], device))
                continue
            results = fn(slice_micro_batch(batch, rows, device))
            for out, res in zip(outputs, results, strict=True):
                out[rows] = pad_to_width(res.float().cpu(), batch.response_length)
    return [all_reduce_sum(out) for out in outputs]
