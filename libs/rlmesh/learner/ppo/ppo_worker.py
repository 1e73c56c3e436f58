"""What the PPO actor and critic share (verl's ``BasePPOActor`` / ``BasePPOCritic``): the engine and
its lr scheduler, the cut of an update into mini-batches and micro-batches, the backward and the
optimizer step that skips non-finite updates."""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from rlmesh.learner.ppo.batch import PPOBatch
from rlmesh.learner.ppo.forward import require_packable
from rlmesh.learner.ppo.parallel import micro_batch_plan
from rlmesh.learner.ppo.partition import mini_batches

__all__ = ["PPOWorker", "UpdateStats", "clip_and_step", "epoch_order", "step_scheduler"]

log = logging.getLogger("rlmesh.learner")

# The metric sum that counts micro-batches: the actor's and critic's means divide by it.
MICRO_BATCHES = "_micro_batches"


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


def epoch_order(size: int, seed: int, step: int, epoch: int, shuffle: bool) -> list[int]:
    """Row order of one PPO epoch: as collected, or a permutation that is a function of
    ``(seed, step, epoch)`` only (the same on every rank and after a resume)."""
    if not shuffle:
        return list(range(size))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + epoch)
    return torch.randperm(size, generator=generator).tolist()


def clip_and_step(engine: Any) -> tuple[float, bool]:
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


def step_scheduler(scheduler: Any) -> None:
    """One lr-scheduler step. verl steps once per PPO step even when every optimizer step was
    skipped; torch then warns that the optimizer did not step first, which is expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        scheduler.step()


class PPOWorker:
    """Args:
    engine: the role's DeepSpeed engine.
    scheduler: its lr scheduler (stepped once per update).
    config: the role's section (``actor_rollout_ref.actor``, ``critic``).
    name: ``actor`` or ``critic``, in logs.
    rollout_n: samples per prompt (a mini-batch is ``ppo_mini_batch_size * rollout_n`` samples).
    norm_len: the constant length of ``seq-mean-token-sum-norm``.
    seed: the shuffle seed.
    device: where micro-batches go.
    share_prompts: run a prompt once for all its samples in a micro-batch where that costs less
        (``rlmesh.learner.ppo.forward.shared_prompt_layout``; equal outputs up to float rounding).
    balance_batch: ``trainer.balance_batch``, the ranks' shares even in tokens.
    pack: micro-batches run padding-free (``rlmesh.learner.ppo.packed_layout``); ValueError at once, naming
        ``pack_key``, when the model cannot.
    """

    def __init__(
        self,
        engine: Any,
        scheduler: Any,
        config: Any,
        *,
        name: str,
        rollout_n: int,
        norm_len: int,
        seed: int,
        device: torch.device,
        share_prompts: bool,
        balance_batch: bool,
        pack: bool,
        pack_key: str,
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.config = config
        self.name = name
        self.rollout_n = rollout_n
        self.norm_len = norm_len
        self.seed = seed
        self.device = device
        self.share_prompts = share_prompts
        self.balance_batch = balance_batch
        self.skipped_steps = 0  # optimizer steps skipped so far in the run
        self.pack = pack
        if pack:
            require_packable(engine, pack_key)

    def mini_batches(self, batch_size: int, step: int, epoch: int) -> list[list[int]]:
        """The global mini-batches of one PPO epoch: ``ppo_mini_batch_size * rollout_n`` rows each,
        in the epoch's order (shuffled when ``shuffle``)."""
        order = epoch_order(batch_size, self.seed, step, epoch, bool(self.config.shuffle))
        return mini_batches(order, int(self.config.ppo_mini_batch_size) * self.rollout_n)

    def micro_batches(self, batch: PPOBatch, rows: list[int]) -> list[list[int]]:
        """This rank's micro-batches of the global mini-batch ``rows``, by ``ppo_micro_batch_size_per_gpu``
        or ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``; as many on every rank, an empty one
        where this rank has fewer rows than another."""
        cfg = self.config
        return micro_batch_plan(
            batch,
            rows,
            cfg.ppo_micro_batch_size_per_gpu,
            cfg.use_dynamic_bsz,
            cfg.ppo_max_token_len_per_gpu,
            self.balance_batch,
        )

    def dummy_backward(self, output: torch.Tensor) -> None:
        """A zero backward through ``output`` (the forward of an empty micro-batch's stand-in rows):
        ZeRO's collectives stay in step with the ranks that have a real micro-batch here, and the
        gradients are untouched."""
        self.engine.backward(output.sum() * 0.0, scale_wrt_gas=False)

    def backward(self, loss: torch.Tensor, output: torch.Tensor) -> bool:
        """Backward of a micro-batch's ``loss`` (already scaled to its share of the global mini-batch),
        accumulated in the engine. A non-finite loss backpropagates NaN through ``output`` instead,
        so every rank's averaged gradient is NaN and the step is skipped everywhere.

        Returns:
            True when ``loss`` was not finite.
        """
        nonfinite = not torch.isfinite(loss)
        if nonfinite:
            loss = output.sum() * float("nan")
        self.engine.backward(loss, scale_wrt_gas=False)
        return bool(nonfinite)

    def optimizer_step(self, stats: UpdateStats, nonfinite_loss: bool, step: int) -> None:
        """The mini-batch's optimizer step (:func:`clip_and_step`), counted in ``stats``; a skipped
        one is counted in ``skipped_steps`` at once and logged with its cause."""
        grad_norm, applied = clip_and_step(self.engine)
        stats.steps += 1
        if applied:
            stats.grad_norms.append(grad_norm)
            return
        stats.skipped += 1
        self.skipped_steps += 1
        cause = "a non-finite loss on this rank" if nonfinite_loss else "a non-finite gradient norm"
        log.error(
            "%s: optimizer step skipped, weights unchanged: %s (grad_norm=%s) at training step %d; skipped_steps=%d",
            self.name, cause, grad_norm, step, self.skipped_steps,
        )  # fmt: skip
