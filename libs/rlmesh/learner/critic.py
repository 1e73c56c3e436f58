"""The PPO critic on a DeepSpeed engine: verl's ``DataParallelPPOCritic`` (``compute_values``,
``update_critic``) with global loss normalisation over the data-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch

from rlmesh.algo import compute_value_loss, masked_mean
from rlmesh.config import CriticConfig
from rlmesh.learner.batch import PPOBatch
from rlmesh.learner.dist import world_size
from rlmesh.learner.forward import MicroBatch, critic_forward, require_packable, rows_of
from rlmesh.learner.parallel import (
    MetricSums,
    forward_without_grad,
    global_loss_scale,
    micro_batch_plan,
    mini_batch_counts,
    step_scheduler,
    train_micro_batches,
    update_epochs,
)

__all__ = ["DeepSpeedPPOCritic"]


class DeepSpeedPPOCritic:
    """Args: the critic's DeepSpeed engine and lr scheduler, ``critic`` config, samples per prompt,
    the constant length of ``seq-mean-token-sum-norm``, the shuffle seed, the device, and
    ``share_prompts`` (as :class:`rlmesh.learner.actor.DeepSpeedPPOActor`'s). Its micro-batches
    run padding-free when ``config.model.use_remove_padding`` (``rlmesh.learner.packing``)."""

    def __init__(
        self,
        engine: Any,
        scheduler: Any,
        config: CriticConfig,
        *,
        rollout_n: int,
        norm_len: int,
        seed: int,
        device: torch.device,
        share_prompts: bool = True,
        balance_batch: bool = True,
    ) -> None:
        self.engine = engine
        self.balance_batch = balance_batch
        self.scheduler = scheduler
        self.config = config
        self.rollout_n = rollout_n
        self.norm_len = norm_len
        self.seed = seed
        self.device = device
        self.skipped_steps = 0
        self.share_prompts = share_prompts
        # critic.model.use_remove_padding, set by data.use_sequence_packing too.
        self.pack = bool(config.model.use_remove_padding)
        if self.pack:
            require_packable(engine, "critic.model.use_remove_padding")

    def compute_values(self, batch: PPOBatch) -> torch.Tensor:
        """Values ``(bs, R)``, zero past each response (as verl), no grad; micro-batches of
        ``forward_micro_batch_size_per_gpu`` or packed by ``forward_max_token_len_per_gpu``."""
        cfg = self.config

        def fn(mb: MicroBatch) -> tuple[torch.Tensor]:
            return (critic_forward(self.engine, mb, self.share_prompts, self.pack),)

        plan = micro_batch_plan(
            batch,
            range(len(batch)),
            cfg.forward_micro_batch_size_per_gpu,
            cfg.use_dynamic_bsz,
            cfg.forward_max_token_len_per_gpu,
            self.balance_batch,
        )
        (values,) = forward_without_grad(self.engine, batch, fn, 1, plan, self.device)
        return values * batch.response_mask

    def mini_batch_backward(
        self, batch: PPOBatch, rows: list[int], values: torch.Tensor, returns: torch.Tensor, sums: MetricSums
    ) -> bool:
        """Forward/backward of this rank's micro-batches of the global mini-batch ``rows``:
        ``s · compute_value_loss(...)`` each (clipped value loss, :func:`global_loss_scale`).
        ``critic/vf_clipfrac`` and ``critic/vpred_mean`` go into ``sums`` once per real
        micro-batch (its token mean), counted under ``_micro_batches``.
        Returns True when a loss was not finite (the step is then skipped on every rank)."""
        cfg = self.config
        mode = cfg.loss_agg_mode
        dp = world_size()
        n_tokens, n_seqs = mini_batch_counts(batch, rows)
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "_micro_batches"):
            sums.add(key, 0.0)  # every rank reduces the same keys, even with only dummy micro-batches
        nonfinite = False

        def forward(mb: MicroBatch) -> tuple[torch.Tensor]:
            return (critic_forward(self.engine, mb, self.share_prompts, self.pack),)

        for micro in train_micro_batches(
            self.engine, batch, rows, cfg, self.device, forward, self.balance_batch
        ):
            micro_rows, mask, w = micro.rows, micro.mask, micro.mb.response_width
            (vpreds,) = micro.outputs
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds,
                rows_of(returns, micro_rows, w, self.device),
                rows_of(values, micro_rows, w, self.device),
                mask,
                cliprange_value=cfg.cliprange_value,
                loss_agg_mode=mode,
            )
            scale = global_loss_scale(mask, mode, n_tokens, n_seqs, dp, self.norm_len)
            loss = vf_loss * scale
            if not torch.isfinite(loss):
                nonfinite = True
                loss = vpreds.sum() * float("nan")
            self.engine.backward(loss, scale_wrt_gas=False)
            sums.add("critic/vf_loss", vf_loss.item() * scale / dp)
            sums.add("critic/vf_clipfrac", vf_clipfrac.item())
            sums.add("critic/vpred_mean", masked_mean(vpreds.detach(), mask).item())
            sums.add("_micro_batches", 1.0)
        return nonfinite

    def update_critic(
        self, batch: PPOBatch, values: torch.Tensor, returns: torch.Tensor, step: int
    ) -> dict[str, float]:
        """``critic.ppo_epochs`` over mini-batches, one optimizer step each, one lr-scheduler step.

        Metrics: ``critic/vf_loss`` is the global mini-batch loss averaged over the optimizer
        steps; ``critic/vf_clipfrac`` and ``critic/vpred_mean`` are, as verl 0.9.1 reduces them,
        the plain mean over the update's micro-batches (every rank's, every mini-batch's) of each
        one's token mean; grad_norm and lr as the actor's.
        """
        cfg = self.config
        mini_size = int(cfg.ppo_mini_batch_size) * self.rollout_n
        lr = self.scheduler.get_last_lr()[0]
        sums = MetricSums()
        stats = update_epochs(
            self,
            "critic",
            len(batch),
            mini_size,
            step,
            lambda rows: self.mini_batch_backward(batch, rows, values, returns, sums),
        )
        step_scheduler(self.scheduler)
        totals = sums.reduced()
        micro_batches = max(totals.pop("_micro_batches", 0.0), 1.0)
        return {
            "critic/vf_loss": totals.get("critic/vf_loss", 0.0) / stats.steps,
            "critic/vf_clipfrac": totals.get("critic/vf_clipfrac", 0.0) / micro_batches,
            "critic/vpred_mean": totals.get("critic/vpred_mean", 0.0) / micro_batches,
            "critic/grad_norm": stats.grad_norm,
            "critic/lr": lr,
            "critic/skipped_steps": float(stats.skipped),
        }
