"""The PPO critic on a DeepSpeed engine: verl's ``DataParallelPPOCritic`` (``compute_values``,
``update_critic``) with global loss normalisation over the data-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch

from rlmesh.algo import compute_value_loss, masked_mean
from rlmesh.config import CriticConfig
from rlmesh.learner.dist import world_size
from rlmesh.learner.ppo.batch import PPOBatch
from rlmesh.learner.ppo.forward import MicroBatch, critic_forward, rows_of, slice_micro_batch
from rlmesh.learner.ppo.parallel import (
    MetricSums,
    forward_without_grad,
    global_loss_scale,
    micro_batch_plan,
    mini_batch_counts,
)
from rlmesh.learner.ppo.ppo_worker import MICRO_BATCHES, PPOWorker, UpdateStats, step_scheduler

__all__ = ["DeepSpeedPPOCritic"]


class DeepSpeedPPOCritic(PPOWorker):
    """Args: the critic's DeepSpeed engine and lr scheduler, ``critic`` config, samples per prompt,
    the constant length of ``seq-mean-token-sum-norm``, the shuffle seed, the device, and
    ``share_prompts`` (as :class:`rlmesh.learner.ppo.actor.DeepSpeedPPOActor`'s). Its micro-batches
    run padding-free when ``config.model.use_remove_padding`` (``rlmesh.learner.ppo.packed_layout``)."""

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
        # critic.model.use_remove_padding, set by data.use_sequence_packing too.
        super().__init__(
            engine,
            scheduler,
            config,
            name="critic",
            rollout_n=rollout_n,
            norm_len=norm_len,
            seed=seed,
            device=device,
            share_prompts=share_prompts,
            balance_batch=balance_batch,
            pack=bool(config.model.use_remove_padding),
            pack_key="critic.model.use_remove_padding",
        )

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

    def update_critic(
        self, batch: PPOBatch, values: torch.Tensor, returns: torch.Tensor, step: int
    ) -> dict[str, float]:
        """``critic.ppo_epochs`` over mini-batches, one optimizer step each, one lr-scheduler step.

        Per micro-batch the loss is ``s · compute_value_loss(...)`` (the clipped value loss, ``s`` its
        global scale, :func:`global_loss_scale`). A non-finite loss on any rank skips that
        mini-batch's optimizer step on every rank.

        Metrics: ``critic/vf_loss`` is the global mini-batch loss averaged over the optimizer
        steps; ``critic/vf_clipfrac`` and ``critic/vpred_mean`` are, as verl 0.9.1 reduces them,
        the plain mean over the update's micro-batches (every rank's, every mini-batch's) of each
        one's token mean; grad_norm and lr as the actor's.
        """
        cfg = self.config
        mode = cfg.loss_agg_mode
        dp = world_size()
        lr = self.scheduler.get_last_lr()[0]
        sums, stats = MetricSums(), UpdateStats()
        self.engine.train()
        for epoch in range(int(cfg.ppo_epochs)):
            for rows in self.mini_batches(len(batch), step, epoch):
                n_tokens, n_seqs = mini_batch_counts(batch, rows)
                for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", MICRO_BATCHES):
                    sums.add(key, 0.0)  # every rank reduces the same keys, even with only dummy micro-batches
                nonfinite = False
                plan = self.micro_batches(batch, rows)
                for i, micro_rows in enumerate(plan):
                    # DeepSpeed reduces the accumulated gradients over the ranks in the last backward.
                    self.engine.set_gradient_accumulation_boundary(i == len(plan) - 1)
                    mb = slice_micro_batch(batch, micro_rows or rows[:1], self.device)
                    vpreds = critic_forward(self.engine, mb, self.share_prompts, self.pack)
                    if not micro_rows:  # this rank has fewer micro-batches than another
                        self.dummy_backward(vpreds)
                        continue
                    w = mb.response_width
                    mask = rows_of(batch.response_mask, micro_rows, w, self.device)
                    vf_loss, vf_clipfrac = compute_value_loss(
                        vpreds,
                        rows_of(returns, micro_rows, w, self.device),
                        rows_of(values, micro_rows, w, self.device),
                        mask,
                        cliprange_value=cfg.cliprange_value,
                        loss_agg_mode=mode,
                    )
                    scale = global_loss_scale(mask, mode, n_tokens, n_seqs, dp, self.norm_len)
                    nonfinite |= self.backward(vf_loss * scale, vpreds)
                    sums.add("critic/vf_loss", vf_loss.item() * scale / dp)
                    sums.add("critic/vf_clipfrac", vf_clipfrac.item())
                    sums.add("critic/vpred_mean", masked_mean(vpreds.detach(), mask).item())
                    sums.add(MICRO_BATCHES, 1.0)
                self.optimizer_step(stats, nonfinite, step)
        step_scheduler(self.scheduler)
        totals = sums.reduced()
        micro_batches = max(totals.pop(MICRO_BATCHES, 0.0), 1.0)
        return {
            "critic/vf_loss": totals.get("critic/vf_loss", 0.0) / stats.steps,
            "critic/vf_clipfrac": totals.get("critic/vf_clipfrac", 0.0) / micro_batches,
            "critic/vpred_mean": totals.get("critic/vpred_mean", 0.0) / micro_batches,
            "critic/grad_norm": stats.grad_norm,
            "critic/lr": lr,
            "critic/skipped_steps": float(stats.skipped),
        }
