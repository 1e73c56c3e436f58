"""The PPO actor on a DeepSpeed engine: verl's ``DataParallelPPOActor`` (``compute_log_prob``,
``update_policy``) with global loss normalisation over the data-parallel ranks."""

from __future__ import annotations

import math
from typing import Any

import torch

from rlmesh.algo import agg_loss, get_policy_loss_fn, kl_penalty
from rlmesh.config import ActorConfig
from rlmesh.learner.batch import PPOBatch
from rlmesh.learner.dist import world_size
from rlmesh.learner.forward import MicroBatch, actor_forward, require_packable, rows_of
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

__all__ = ["DeepSpeedPPOActor"]


class DeepSpeedPPOActor:
    """Args:
    engine: the actor's DeepSpeed engine.
    scheduler: its lr scheduler (stepped once per :meth:`update_policy`).
    config: ``actor_rollout_ref.actor``.
    rollout_n: samples per prompt (a mini-batch is ``ppo_mini_batch_size * rollout_n`` samples).
    temperature: the rollout temperature; logits are divided by it, as verl does.
    norm_len: the constant length of ``seq-mean-token-sum-norm``.
    seed: the shuffle seed.
    device: where micro-batches go.
    share_prompts: run a prompt once for all its samples in a micro-batch where that costs less
        (``rlmesh.learner.forward.shared_prompt_layout``; equal outputs up to float rounding).

    Its micro-batches (training and old log-probs) run padding-free when ``config.use_remove_padding``
    (``rlmesh.learner.packing``; ValueError at once when the model cannot).
    """

    def __init__(
        self,
        engine: Any,
        scheduler: Any,
        config: ActorConfig,
        *,
        rollout_n: int,
        temperature: float,
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
        self.temperature = temperature
        self.norm_len = norm_len
        self.seed = seed
        self.device = device
        self.entropy_coeff = float(config.entropy_coeff)
        self.kl_loss_coef = float(config.kl_loss_coef)
        self.skipped_steps = 0
        self.share_prompts = share_prompts
        # Resolved from actor_rollout_ref.model.use_remove_padding and data.use_sequence_packing.
        self.pack = bool(config.use_remove_padding)
        if self.pack:
            require_packable(engine, "actor_rollout_ref.model.use_remove_padding")

    def compute_log_prob(
        self,
        batch: PPOBatch,
        micro_batch_size: int | None = None,
        use_dynamic_bsz: bool | None = False,
        max_token_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies ``(bs, R)`` of the response tokens, no grad, zero past each
        response."""

        def fn(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
            log_probs, entropy = actor_forward(
                self.engine,
                mb,
                self.temperature,
                calculate_entropy=True,
                share_prompts=self.share_prompts,
                pack=self.pack,
            )
            assert entropy is not None
            return log_probs, entropy

        plan = micro_batch_plan(
            batch, range(len(batch)), micro_batch_size, use_dynamic_bsz, max_token_len, self.balance_batch
        )
        log_probs, entropy = forward_without_grad(self.engine, batch, fn, 2, plan, self.device)
        mask = batch.response_mask.bool()
        return log_probs * mask, entropy * mask

    def mini_batch_backward(
        self,
        batch: PPOBatch,
        rows: list[int],
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        rollout_is_weights: torch.Tensor | None,
        on_policy: bool,
        sums: MetricSums,
    ) -> bool:
        """Forward/backward of this rank's micro-batches of one global mini-batch ``rows`` (no
        optimizer step); gradients accumulate in the engine.

        Per micro-batch, with :math:`s` the global scale (:func:`global_loss_scale`):

        .. math:: \\mathcal{L} = s\\,\\big(\\mathcal{L}_{pg} - c_H\\,\\mathrm{agg}(H)
                  + c_{KL}\\,\\mathrm{agg}(\\mathrm{KL}(\\pi_\\theta \\| \\pi_{ref}))\\big)

        Returns:
            True when a micro-batch loss was not finite; its backward then runs on NaN so every
            rank's averaged gradient is NaN and the optimizer step is skipped everywhere.
        """
        cfg = self.config
        mode = cfg.loss_agg_mode
        policy_loss_fn = get_policy_loss_fn(cfg.policy_loss.loss_mode)
        dp = world_size()
        n_tokens, n_seqs = mini_batch_counts(batch, rows)
        calculate_entropy = self.entropy_coeff != 0
        # Every rank reduces the same keys, even one that only ran dummy micro-batches.
        keys = ["actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "_tokens"]
        if calculate_entropy:
            keys.append("actor/entropy_loss")
        if cfg.use_kl_loss:
            keys.append("actor/kl_loss")
        for key in keys:
            sums.add(key, 0.0)
        nonfinite = False

        def forward(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
            return actor_forward(
                self.engine, mb, self.temperature, calculate_entropy, self.share_prompts, self.pack
            )

        for micro in train_micro_batches(
            self.engine, batch, rows, cfg, self.device, forward, self.balance_batch
        ):
            micro_rows, mask, w = micro.rows, micro.mask, micro.mb.response_width
            log_prob, entropy = micro.outputs
            # verl: with one mini-batch and one epoch the data is exactly on-policy; the ratio is
            # then taken against the detached current log-prob (equal in value).
            old = log_prob.detach() if on_policy else rows_of(old_log_probs, micro_rows, w, self.device)
            weights = None
            if rollout_is_weights is not None:
                weights = rows_of(rollout_is_weights, micro_rows, w, self.device)
            pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = policy_loss_fn(
                old,
                log_prob,
                rows_of(advantages, micro_rows, w, self.device),
                mask,
                cliprange=cfg.clip_ratio,
                cliprange_low=cfg.clip_ratio_low,
                cliprange_high=cfg.clip_ratio_high,
                clip_ratio_c=cfg.clip_ratio_c,
                loss_agg_mode=mode,
                rollout_is_weights=weights,
            )
            scale = global_loss_scale(mask, mode, n_tokens, n_seqs, dp, self.norm_len)
            policy_loss = pg_loss
            if calculate_entropy:
                entropy_loss = agg_loss(entropy, mask, mode)
                policy_loss = policy_loss - self.entropy_coeff * entropy_loss
                sums.add("actor/entropy_loss", entropy_loss.item() * scale / dp)
            if cfg.use_kl_loss:
                assert batch.ref_log_probs is not None
                ref = rows_of(batch.ref_log_probs, micro_rows, w, self.device)
                kl_loss = agg_loss(kl_penalty(log_prob, ref, cfg.kl_loss_type), mask, mode)
                policy_loss = policy_loss + self.kl_loss_coef * kl_loss
                sums.add("actor/kl_loss", kl_loss.item() * scale / dp)
            loss = policy_loss * scale
            if not torch.isfinite(loss):
                nonfinite = True
                loss = log_prob.sum() * float("nan")
            self.engine.backward(loss, scale_wrt_gas=False)
            tokens = float(mask.sum())
            sums.add("actor/pg_loss", pg_loss.item() * scale / dp)
            sums.add("actor/pg_clipfrac", pg_clipfrac.item() * tokens)
            sums.add("actor/ppo_kl", ppo_kl.item() * tokens)
            sums.add("actor/pg_clipfrac_lower", pg_clipfrac_lower.item() * tokens)
            sums.add("_tokens", tokens)
        return nonfinite

    def update_policy(
        self,
        batch: PPOBatch,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        rollout_is_weights: torch.Tensor | None,
        step: int,
    ) -> dict[str, float]:
        """``ppo_epochs`` over mini-batches of ``ppo_mini_batch_size * n`` samples, one optimizer
        step each, then one lr-scheduler step.

        Metrics: losses are the global mini-batch losses averaged over the optimizer steps;
        clip fractions and ppo_kl are token-weighted over the whole update; grad_norm is the mean
        over applied steps (before clipping); lr is the one used.
        """
        cfg = self.config
        mini_size = cfg.ppo_mini_batch_size * self.rollout_n
        on_policy = math.ceil(len(batch) / mini_size) == 1 and cfg.ppo_epochs == 1
        lr = self.scheduler.get_last_lr()[0]
        sums = MetricSums()
        stats = update_epochs(
            self,
            "actor",
            len(batch),
            mini_size,
            step,
            lambda rows: self.mini_batch_backward(
                batch, rows, old_log_probs, advantages, rollout_is_weights, on_policy, sums
            ),
        )
        step_scheduler(self.scheduler)  # once per PPO step, as verl's update_actor
        totals = sums.reduced()
        tokens = max(totals.pop("_tokens", 0.0), 1.0)
        metrics = {
            "actor/pg_loss": totals.get("actor/pg_loss", 0.0) / stats.steps,
            "actor/kl_loss": totals.get("actor/kl_loss", 0.0) / stats.steps,
            "actor/pg_clipfrac": totals.get("actor/pg_clipfrac", 0.0) / tokens,
            "actor/ppo_kl": totals.get("actor/ppo_kl", 0.0) / tokens,
            "actor/pg_clipfrac_lower": totals.get("actor/pg_clipfrac_lower", 0.0) / tokens,
            "actor/grad_norm": stats.grad_norm,
            "actor/lr": lr,
            "actor/skipped_steps": float(stats.skipped),
        }
        if "actor/entropy_loss" in totals:
            metrics["actor/entropy_loss"] = totals["actor/entropy_loss"] / stats.steps
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = self.kl_loss_coef
        return metrics
