"""Data-parallel pieces shared by the actor and the critic: global loss scaling, metric sums over
ranks, forward passes without grad over a sharded batch, and the optimizer step that skips
non-finite updates."""

from __future__ import annotations

import logging
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlmesh.learner.batch import PPOBatch
from rlmesh.learner.dist import all_reduce_sum, rank, world_size
from rlmesh.learner.forward import MicroBatch, pad_to_width, rows_of, slice_micro_batch
from rlmesh.learner.partition import mini_batches, plan_micro_batches

__all__ = [
    "MetricSums",
    "PPORole",
    "TrainMicroBatch",
    "UpdateStats",
    "epoch_order",
    "forward_without_grad",
    "global_loss_scale",
    "log_skipped_step",
    "micro_batch_plan",
    "mini_batch_counts",
    "optimizer_step",
    "step_scheduler",
    "train_micro_batches",
    "update_epochs",
]

log = logging.getLogger("rlmesh.learner")


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


def epoch_order(size: int, seed: int, step: int, epoch: int, shuffle: bool) -> list[int]:
    """Row order of one PPO epoch: as collected, or a permutation that is a function of
    ``(seed, step, epoch)`` only (the same on every rank and after a resume)."""
    if not shuffle:
        return list(range(size))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + epoch)
    return torch.randperm(size, generator=generator).tolist()


def micro_batch_plan(
    batch: PPOBatch,
    rows: Sequence[int],
    micro_batch_size: int | None,
    use_dynamic_bsz: bool | None,
    max_token_len: int | None,
    balance: bool = True,
) -> list[list[int]]:
    """This rank's micro-batches of ``rows`` (see :func:`rlmesh.learner.partition.plan_micro_batches`);
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


def optimizer_step(engine: Any) -> tuple[float, bool]:
    """Clip and step, or skip when the gradient norm is not finite.

    DeepSpeed's ZeRO and bf16/fp16 optimizers check the global norm themselves and skip a
    non-finite step (``was_step_applied``); a stage-0 fp32 engine steps the client optimizer
    directly, so its (already all-reduced) gradients are checked here first.

    Returns:
        grad_norm: global norm before clipping (inf/NaN when skipped).
        applied: whether the weights changed.
    """
    if engine.zero_optimization_stage() == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if not math.isfinite(grad_norm):
            engine.zero_grad()
            return grad_norm, False
        engine.step()
        return grad_norm, True
    engine.step()
    norm = engine.get_global_grad_norm()
    return (float("nan") if norm is None else float(norm)), bool(engine.was_step_applied())


def log_skipped_step(role: str, nonfinite_loss: bool, grad_norm: float, step: int, skipped: int) -> None:
    cause = "a non-finite loss on this rank" if nonfinite_loss else "a non-finite gradient norm"
    log.error(
        "%s: optimizer step skipped, weights unchanged: %s (grad_norm=%s) at training step %d; skipped_steps=%d",
        role, cause, grad_norm, step, skipped,
    )  # fmt: skip


def step_scheduler(scheduler: Any) -> None:
    """One lr-scheduler step. verl steps once per PPO step even when every optimizer step was
    skipped; torch then warns that the optimizer did not step first, which is expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        scheduler.step()


@dataclass
class TrainMicroBatch:
    """One real micro-batch of a mini-batch under training: its rows, the trimmed inputs, the
    forward's outputs and the ``(n, w)`` response mask."""

    rows: list[int]
    mb: MicroBatch
    outputs: tuple[Any, ...]
    mask: torch.Tensor


def train_micro_batches(
    engine: Any,
    batch: PPOBatch,
    rows: list[int],
    config: Any,
    device: torch.device,
    forward: Callable[[MicroBatch], tuple[Any, ...]],
    balance: bool = True,
) -> Iterator[TrainMicroBatch]:
    """This rank's micro-batches of the global mini-batch ``rows`` in train mode, by the role's
    ``ppo_micro_batch_size_per_gpu`` / ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``: sets
    the gradient-accumulation boundary on the last one and runs ``forward`` (whose first output is
    a tensor of the graph). A rank left without rows runs a dummy micro-batch with a zero backward
    — ZeRO's collectives stay in step with the other ranks, the gradients are untouched — and it
    is not yielded; the caller computes and backpropagates the loss of each yielded one."""
    plan = micro_batch_plan(
        batch,
        rows,
        config.ppo_micro_batch_size_per_gpu,
        config.use_dynamic_bsz,
        config.ppo_max_token_len_per_gpu,
        balance,
    )
    engine.train()
    for i, micro_rows in enumerate(plan):
        engine.set_gradient_accumulation_boundary(i == len(plan) - 1)
        mb = slice_micro_batch(batch, micro_rows or rows[:1], device)
        outputs = forward(mb)
        if not micro_rows:
            engine.backward(outputs[0].sum() * 0.0, scale_wrt_gas=False)
            continue
        yield TrainMicroBatch(
            micro_rows, mb, outputs, rows_of(batch.response_mask, micro_rows, mb.response_width, device)
        )


@dataclass
class UpdateStats:
    """The optimizer steps of one update: how many ran, how many were skipped, the applied norms."""

    steps: int = 0
    skipped: int = 0
    grad_norms: list[float] = field(default_factory=list)

    @property
    def grad_norm(self) -> float:
        """Mean gradient norm (before clipping) over the applied steps; NaN when none was."""
        return sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else float("nan")


class PPORole(Protocol):
    """The actor or the critic, as ``update_epochs`` uses it."""

    engine: Any
    config: Any  # its config section: ppo_epochs, shuffle
    seed: int
    skipped_steps: int  # optimizer steps skipped so far in the run


def update_epochs(
    role: PPORole,
    name: str,
    batch_size: int,
    mini_size: int,
    step: int,
    mini_batch_backward: Callable[[list[int]], bool],
) -> UpdateStats:
    """verl's update loop: ``ppo_epochs`` passes over the batch in mini-batches of ``mini_size``
    (shuffled per epoch when ``shuffle``), one optimizer step after each mini-batch's backward
    (``mini_batch_backward(rows)``, True when a loss was not finite). A skipped step is counted
    in ``role.skipped_steps`` at once and logged under ``name``."""
    stats = UpdateStats()
    config = role.config
    for epoch in range(int(config.ppo_epochs)):
        order = epoch_order(batch_size, role.seed, step, epoch, bool(config.shuffle))
        for rows in mini_batches(order, mini_size):
            nonfinite = mini_batch_backward(rows)
            grad_norm, applied = optimizer_step(role.engine)
            stats.steps += 1
            if applied:
                stats.grad_norms.append(grad_norm)
            else:
                stats.skipped += 1
                role.skipped_steps += 1
                log_skipped_step(name, nonfinite, grad_norm, step, role.skipped_steps)
    return stats
