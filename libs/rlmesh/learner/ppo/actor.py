"""The PPO actor on a DeepSpeed engine: verl's ``DataParallelPPOActor`` (``compute_log_prob``,
``update_policy``) with global loss normalisation over the data-parallel ranks, training with the
policy loss ``policy_loss.loss_mode`` selects (rlmesh.algo.losses' registry)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from rlmesh.algo import agg_loss, get_policy_loss_fn, kl_penalty, policy_loss_info
from rlmesh.config import ActorConfig
from rlmesh.learner.dist import world_size
from rlmesh.learner.ppo.batch import PPOBatch
from rlmesh.learner.ppo.forward import MicroBatch, actor_forward, rows_of, slice_micro_batch
from rlmesh.learner.ppo.parallel import (
    MetricSums,
    forward_without_grad,
    global_loss_scale,
    micro_batch_plan,
    mini_batch_counts,
)
from rlmesh.learner.ppo.ppo_worker import MICRO_BATCHES, PPOWorker, UpdateStats, step_scheduler

__all__ = ["DeepSpeedPPOActor", "policy_loss_kwargs"]


def policy_loss_kwargs(config: ActorConfig, generator: torch.Generator | None = None) -> dict[str, Any]:
    """The knobs the configured policy loss reads, as its keyword arguments (verl's loss
    functions read the same keys from the actor config they are given).

    ``generator`` drives clip_cov's random choice of tokens.
    """
    loss = config.policy_loss
    mode = loss.loss_mode
    clip = {
        "cliprange": config.clip_ratio,
        "cliprange_low": config.clip_ratio_low,
        "cliprange_high": config.clip_ratio_high,
    }
    if mode in ("vanilla", "dppo_tv", "dppo_kl"):
        return {**clip, "clip_ratio_c": config.clip_ratio_c}
    if mode in ("gspo", "geo_mean", "cispo"):
        return clip
    if mode == "clip_cov":
        return {
            **clip,
            "clip_cov_ratio": loss.clip_cov_ratio,
            "clip_cov_lb": loss.clip_cov_lb,
            "clip_cov_ub": loss.clip_cov_ub,
            "generator": generator,
        }
    if mode == "kl_cov":
        return {"kl_cov_ratio": loss.kl_cov_ratio, "ppo_kl_coef": loss.ppo_kl_coef}
    if mode == "sapo":
        return {"tau_pos": config.tau_pos, "tau_neg": config.tau_neg}
    if mode == "dro":
        return {"dro_beta": loss.dro_beta}
    if mode == "gpg":
        return {}
    raise ValueError(f"policy_loss_kwargs: no knobs known for policy loss {mode!r}")


def _mini_batch_key(key: str, mini_batch: int) -> str:
    """The MetricSums key of ``key``'s sum over the micro-batches of the update's
    ``mini_batch``-th mini-batch (epochs included)."""
    return f"{key}#{mini_batch}"


def _mean_over_mini_batches(
    totals: dict[str, float], keys: Sequence[str], n_mini_batches: int
) -> dict[str, float]:
    """verl 0.9.1's reduction of a metric with one value per micro-batch: mean over the
    micro-batches of all ranks within each mini-batch (``Metric.aggregate_dp``), then over the
    update's mini-batches (``reduce_metrics``). With :math:`B_j` the real micro-batches of
    mini-batch :math:`j` (every rank's) and :math:`m_b` a micro-batch's value:

    .. math:: \\bar m = \\frac{1}{M} \\sum_{j=1}^{M} \\frac{1}{|B_j|} \\sum_{b \\in B_j} m_b

    ``totals``: the reduced MetricSums, under ``_mini_batch_key``.
    """
    out = {}
    for key in keys:
        per_mini = [
            totals[_mini_batch_key(key, j)] / max(totals[_mini_batch_key(MICRO_BATCHES, j)], 1.0)
            for j in range(n_mini_batches)
        ]
        out[key] = sum(per_mini) / max(n_mini_batches, 1)
    return out


class DeepSpeedPPOActor(PPOWorker):
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
        (``rlmesh.learner.ppo.forward.shared_prompt_layout``; equal outputs up to float rounding).

    Its micro-batches (training and old log-probs) run padding-free when ``config.use_remove_padding``
    (``rlmesh.learner.ppo.packed_layout``; ValueError at once when the model cannot).
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
        # Resolved from actor_rollout_ref.model.use_remove_padding and data.use_sequence_packing.
        super().__init__(
            engine,
            scheduler,
            config,
            name="actor",
            rollout_n=rollout_n,
            norm_len=norm_len,
            seed=seed,
            device=device,
            share_prompts=share_prompts,
            balance_batch=balance_batch,
            pack=bool(config.use_remove_padding),
            pack_key="actor_rollout_ref.model.use_remove_padding",
        )
        self.temperature = temperature
        self.entropy_coeff = float(config.entropy_coeff)
        self.kl_loss_coef = float(config.kl_loss_coef)
        # clip_cov's random token choice: reseeded from (seed, step) by every update, so a run
        # and its resume choose the same tokens.
        self.loss_generator = torch.Generator()

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

        Per micro-batch, with :math:`s` the global scale (:func:`global_loss_scale`) of
        ``loss_agg_mode`` and :math:`s_{pg}` that of the aggregation the policy loss uses (the
        same but for sapo and geo_mean, which always average over sequences):

        .. math:: \\mathcal{L} = s_{pg}\\,\\mathcal{L}_{pg} + s\\,\\big(- c_H\\,\\mathrm{agg}(H)
                  + c_{KL}\\,\\mathrm{agg}(\\mathrm{KL}(\\pi_\\theta \\| \\pi_{ref}))\\big)

        A non-finite loss on any rank skips that mini-batch's optimizer step on every rank.

        Metrics: losses are the global mini-batch losses averaged over the optimizer steps;
        the policy loss's own metrics (clip fractions and ppo_kl, as verl defines them for the
        loss mode; none for gpg) are, as verl 0.9.1 reduces them, each micro-batch's value
        averaged over the micro-batches of all ranks in a mini-batch, then over the mini-batches
        (``_mean_over_mini_batches``); ``actor/entropy_loss`` is logged when
        ``calculate_entropy`` or ``entropy_coeff != 0``; grad_norm is the mean over applied steps
        (before clipping); lr is the one used.
        """
        cfg = self.config
        mode = cfg.loss_agg_mode
        policy_loss_fn = get_policy_loss_fn(cfg.policy_loss.loss_mode)
        info = policy_loss_info(cfg.policy_loss.loss_mode)
        pg_mode = info.loss_agg_mode or mode
        self.loss_generator.manual_seed(self.seed * 1_000_003 + step)
        knobs = policy_loss_kwargs(cfg, self.loss_generator)
        # verl: entropy in the update (and actor/entropy_loss) when asked for or in the loss
        calculate_entropy = bool(cfg.calculate_entropy) or self.entropy_coeff != 0
        # verl: with one mini-batch and one epoch the data is exactly on-policy; the ratio is
        # then taken against the detached current log-prob (equal in value).
        mini_size = cfg.ppo_mini_batch_size * self.rollout_n
        on_policy = math.ceil(len(batch) / mini_size) == 1 and cfg.ppo_epochs == 1
        dp = world_size()
        lr = self.scheduler.get_last_lr()[0]
        sums, stats = MetricSums(), UpdateStats()
        self.engine.train()
        for epoch in range(int(cfg.ppo_epochs)):
            for rows in self.mini_batches(len(batch), step, epoch):
                j = stats.steps  # the mini-batch's index in the update, epochs included
                n_tokens, n_seqs = mini_batch_counts(batch, rows)
                # Every rank reduces the same keys, even one that only runs dummy micro-batches.
                keys = ["actor/pg_loss", *(_mini_batch_key(k, j) for k in (*info.metrics, MICRO_BATCHES))]
                if calculate_entropy:
                    keys.append("actor/entropy_loss")
                if cfg.use_kl_loss:
                    keys.append("actor/kl_loss")
                for key in keys:
                    sums.add(key, 0.0)
                nonfinite = False
                plan = self.micro_batches(batch, rows)
                for i, micro_rows in enumerate(plan):
                    # DeepSpeed reduces the accumulated gradients over the ranks in the last backward.
                    self.engine.set_gradient_accumulation_boundary(i == len(plan) - 1)
                    mb = slice_micro_batch(batch, micro_rows or rows[:1], self.device)
                    log_prob, entropy = actor_forward(
                        self.engine, mb, self.temperature, calculate_entropy, self.share_prompts, self.pack
                    )
                    if not micro_rows:  # this rank has fewer micro-batches than another
                        self.dummy_backward(log_prob)
                        continue
                    w = mb.response_width
                    mask = rows_of(batch.response_mask, micro_rows, w, self.device)
                    old = (
                        log_prob.detach() if on_policy else rows_of(old_log_probs, micro_rows, w, self.device)
                    )
                    weights = None
                    if rollout_is_weights is not None:
                        weights = rows_of(rollout_is_weights, micro_rows, w, self.device)
                    pg_loss, pg_metrics = policy_loss_fn(
                        old,
                        log_prob,
                        rows_of(advantages, micro_rows, w, self.device),
                        mask,
                        loss_agg_mode=mode,
                        rollout_is_weights=weights,
                        **knobs,
                    )
                    scale = global_loss_scale(mask, mode, n_tokens, n_seqs, dp, self.norm_len)
                    # Each term times the scale of its own aggregation (sapo's and geo_mean's differ).
                    pg_scale = global_loss_scale(mask, pg_mode, n_tokens, n_seqs, dp, self.norm_len)
                    loss = pg_loss * pg_scale
                    if calculate_entropy:
                        entropy_loss = agg_loss(entropy, mask, mode)
                        if self.entropy_coeff != 0:  # only logged otherwise (calculate_entropy)
                            loss = loss - self.entropy_coeff * entropy_loss * scale
                        sums.add("actor/entropy_loss", entropy_loss.item() * scale / dp)
                    if cfg.use_kl_loss:
                        assert batch.ref_log_probs is not None
                        ref = rows_of(batch.ref_log_probs, micro_rows, w, self.device)
                        kl_loss = agg_loss(kl_penalty(log_prob, ref, cfg.kl_loss_type), mask, mode)
                        loss = loss + self.kl_loss_coef * kl_loss * scale
                        sums.add("actor/kl_loss", kl_loss.item() * scale / dp)
                    nonfinite |= self.backward(loss, log_prob)
                    sums.add("actor/pg_loss", pg_loss.item() * pg_scale / dp)
                    for key in info.metrics:  # each micro-batch's own value (its token mean)
                        sums.add(_mini_batch_key(key, j), pg_metrics[key].item())
                    sums.add(_mini_batch_key(MICRO_BATCHES, j), 1.0)
                self.optimizer_step(stats, nonfinite, step)
        step_scheduler(self.scheduler)  # once per PPO step, as verl's update_actor
        totals = sums.reduced()
        metrics = {
            "actor/pg_loss": totals.get("actor/pg_loss", 0.0) / stats.steps,
            "actor/kl_loss": totals.get("actor/kl_loss", 0.0) / stats.steps,
            **_mean_over_mini_batches(totals, info.metrics, stats.steps),
            "actor/grad_norm": stats.grad_norm,
            "actor/lr": lr,
            "actor/skipped_steps": float(stats.skipped),
        }
        if "actor/entropy_loss" in totals:
            metrics["actor/entropy_loss"] = totals["actor/entropy_loss"] / stats.steps
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = self.kl_loss_coef
        return metrics
