"""PPOTrainer: verl's PPO update (actor + critic) under DeepSpeed ZeRO, as a library.

docs/design.md#one-ppo-step-as-data and docs/design.md#learner-ranks"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from rlmesh.algo import (
    KLController,
    agg_loss,
    apply_kl_penalty,
    compute_advantage,
    compute_rollout_correction,
    get_kl_controller,
    masked_mean,
)
from rlmesh.config import RLMeshConfig
from rlmesh.config.loader import dump_public_yaml
from rlmesh.learner.checkpoints.background import CheckpointWriter
from rlmesh.learner.checkpoints.hf_dir import write_hf_dir
from rlmesh.learner.checkpoints.store import Engines, load_checkpoint, save_checkpoint
from rlmesh.learner.dist import barrier, init_distributed, rank, world_size
from rlmesh.learner.ppo.actor import DeepSpeedPPOActor
from rlmesh.learner.ppo.batch import BatchError, PPOBatch, batch_metrics, staleness_metrics
from rlmesh.learner.ppo.colocated_reference import ColocatedReference, colocated_reference
from rlmesh.learner.ppo.critic import DeepSpeedPPOCritic
from rlmesh.learner.ppo.deepspeed_engine import build_engine
from rlmesh.learner.ppo.forward import greedy_generate
from rlmesh.learner.ppo.model_loading import (
    first_policy_version,
    hf_model,
    load_actor_model,
    load_critic_model,
)
from rlmesh.learner.ppo.overlap import Phase, PhaseRunner
from rlmesh.learner.ppo.schedule import build_lr_scheduler, set_base_lr
from rlmesh.learner.weight_sync.full_weights import iter_weight_buckets

__all__ = ["PPOTrainer"]

log = logging.getLogger("rlmesh.learner")


class PPOTrainer:
    """The learner's model math: actor (+ critic for GAE) under DeepSpeed, one PPO step at a time.

    Args:
        config: the run's config (``actor_rollout_ref.*``, ``critic.*``, ``algorithm.*``).
        total_training_steps: PPO steps of the run (lr warmup and cosine decay count them).
        seed: epoch shuffles and new-weight initialisation (value head, LoRA adapters); default
            ``actor.data_loader_seed`` (42).

    Attributes:
        actor: :class:`DeepSpeedPPOActor` (its DeepSpeed engine is ``actor.engine``).
        critic: :class:`DeepSpeedPPOCritic`, or None without a critic.
        kl_ctrl: the KL-in-reward controller used when :meth:`train_step` is given none.
        reference: the colocated reference (``rlmesh.reference.colocated``), or None: the
            batch's own ``ref_log_probs`` (from the reference service) are used.
        global_steps: training steps done (restored by :meth:`load_checkpoint`).
    """

    def __init__(self, config: RLMeshConfig, total_training_steps: int, *, seed: int | None = None) -> None:
        init_distributed(timeout_s=config.actor_rollout_ref.nccl_timeout, device=config.trainer.device)
        self.config = config
        self.checkpoint_writer = CheckpointWriter()  # save_checkpoint(background=True)'s
        # What every checkpoint keeps of the config (secrets masked), made once: dumping it to YAML
        # took 80 % of a background checkpoint's time in the step on the demo's model.
        self._config_yaml = dump_public_yaml(config)
        self.total_training_steps = int(total_training_steps)
        self.rank, self.dp_size = rank(), world_size()
        self.device = torch.device(get_accelerator().current_device_name())
        arr = config.actor_rollout_ref
        actor_cfg, critic_cfg = arr.actor, config.critic
        self.algo_cfg = config.algorithm
        self.seed = int(actor_cfg.data_loader_seed if seed is None else seed)
        self.max_response_length = int(arr.rollout.response_length or config.data.max_response_length)
        self.max_prompt_length = int(arr.rollout.prompt_length or config.data.max_prompt_length)
        # seq-mean-token-sum-norm divides by a constant: verl's actor.loss_scale_factor, else the
        # configured response length (each micro-batch's own padded width would vary).
        norm_len = int(actor_cfg.loss_scale_factor or self.max_response_length)
        # verl scores sampled tokens under softmax(logits / rollout temperature).
        temperature = arr.rollout.temperature if arr.rollout.temperature > 0 else 1.0

        model = arr.model
        actor_module = load_actor_model(
            model.path,
            seed=self.seed,
            lora_rank=model.lora_rank,
            lora_alpha=model.lora_alpha,
            target_modules=model.target_modules,
            lora_adapter_path=model.lora_adapter_path,
            enable_gradient_checkpointing=model.enable_gradient_checkpointing,
            trust_remote_code=model.trust_remote_code,
            override_config=model.override_config,
        )
        self.vocab_size = int(hf_model(actor_module).config.vocab_size)
        engine, optimizer = build_engine(
            actor_module,
            actor_cfg.optim,
            actor_cfg.effective_engine(),
            actor_cfg.grad_clip,
            self.dp_size,
            optimizer_threads=config.rlmesh.learner.optimizer_threads,
        )
        self.actor = DeepSpeedPPOActor(
            engine,
            build_lr_scheduler(optimizer, actor_cfg.optim, self.total_training_steps),
            actor_cfg,
            rollout_n=arr.rollout.n,
            temperature=temperature,
            norm_len=norm_len,
            seed=self.seed,
            device=self.device,
            balance_batch=config.trainer.balance_batch,
        )

        self.critic: DeepSpeedPPOCritic | None = None
        if config.uses_critic():
            cm = critic_cfg.model
            # verl's critic.model.path defaults to the actor's path (an interpolation); this
            # config has a fixed default instead, which therefore stands for "the actor's path".
            critic_path = model.path if cm.path == type(cm).model_fields["path"].default else cm.path
            critic_module = load_critic_model(
                critic_path,
                seed=self.seed,
                lora_rank=cm.lora_rank,
                lora_alpha=cm.lora_alpha,
                target_modules=cm.target_modules,
                enable_gradient_checkpointing=cm.enable_gradient_checkpointing,
                trust_remote_code=bool(cm.trust_remote_code),
                override_config=cm.override_config,
            )
            engine, optimizer = build_engine(
                critic_module,
                critic_cfg.optim,
                critic_cfg.effective_engine(),
                critic_cfg.grad_clip,
                self.dp_size,
                optimizer_threads=config.rlmesh.learner.optimizer_threads,
            )
            self.critic = DeepSpeedPPOCritic(
                engine,
                build_lr_scheduler(optimizer, critic_cfg.optim, self.total_training_steps),
                critic_cfg,
                rollout_n=arr.rollout.n,
                norm_len=norm_len,
                seed=self.seed,
                device=self.device,
                balance_batch=config.trainer.balance_batch,
            )

        # Frozen and outside DeepSpeed: rebuilt from its path, never checkpointed.
        self.reference: ColocatedReference | None = colocated_reference(config, self.device)
        self.kl_ctrl = get_kl_controller(self.algo_cfg.kl_ctrl)
        self._pending_kl_coef: float | None = None
        self.global_steps = 0
        self.first_version = first_policy_version(model.lora_adapter_path)
        self.bypass_mode = self.algo_cfg.rollout_correction.bypass_mode
        # Threads side by side only in a group of one: ranks must issue collectives in one order.
        self.phases = PhaseRunner(config.rlmesh.learner.overlap_phases and self.dp_size == 1)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient norm (actor + critic)."""
        return self.actor.skipped_steps + (self.critic.skipped_steps if self.critic is not None else 0)

    # ------------------------------------------------------------------ forward passes

    def compute_log_prob(self, batch: PPOBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Actor log-probs and entropies ``(bs, R)`` of the response tokens (zero past each
        response), no grad; micro-batches of ``rollout.log_prob_micro_batch_size_per_gpu`` or
        packed by ``rollout.log_prob_max_token_len_per_gpu`` (``log_prob_use_dynamic_bsz``)."""
        rollout = self.config.actor_rollout_ref.rollout
        return self.actor.compute_log_prob(
            batch,
            rollout.log_prob_micro_batch_size_per_gpu,
            rollout.log_prob_use_dynamic_bsz,
            rollout.log_prob_max_token_len_per_gpu,
        )

    def compute_values(self, batch: PPOBatch) -> torch.Tensor:
        """Critic values ``(bs, R)``, zero past each response, no grad, micro-batched."""
        if self.critic is None:
            raise RuntimeError("no critic: algorithm.adv_estimator is not gae and critic.enable is not set")
        return self.critic.compute_values(batch)

    # ------------------------------------------------------------------ one PPO step

    def train_step(
        self, batch: PPOBatch, kl_ctrl: KLController | None = None, *, update_actor: bool | None = None
    ) -> dict[str, float]:
        """One PPO step on a collected batch (the steps of verl's ``fit`` after the reward).

        Returns verl's metric names: ``actor/{pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl,
        entropy, grad_norm, lr, kl_loss}``, ``critic/{vf_loss, vf_clipfrac, grad_norm, lr}``,
        ``critic/{score, rewards, advantages, returns, values}/{mean, max, min}``,
        ``actor/reward_kl_penalty{,_coeff}`` (KL in the reward), ``response_length/{mean, clip_ratio}``,
        ``timing_s/{ref, old_log_prob, values, adv, update_critic, update_actor}`` (seconds; ``ref``
        with a colocated reference only) with
        ``timing_start/*`` (when each began, Unix seconds), ``rollout_corr/*``,
        ``training/rollout_logprob_abs_diff``, ``training/staleness/{mean, max, min}`` (policy
        versions the samples lag the trained weights), and ``{actor,critic}/skipped_steps`` (this
        step), ``training/skipped_steps`` (the run).

        Args:
            batch: from :func:`rlmesh.learner.build_batch`, identical on every rank.
            kl_ctrl: the KL-in-reward controller (updated in place, as verl does); default the
                trainer's own ``kl_ctrl``.
            update_actor: train the actor this step; default verl's ``trainer.critic_warmup`` rule
                (the actor trains at step ``s`` = global_steps + 1 iff ``critic_warmup <= s``;
                before that only the critic trains and ``training/actor_updated`` is 0).

        Raises:
            BatchError: a non-finite score, a token id outside the vocabulary, no reference
                log-probs while a KL term needs them and no reference is colocated, or (remax)
                a missing or non-finite baseline; nothing is trained then.
        """
        self._check_batch(batch)
        if update_actor is None:
            update_actor = self.config.trainer.critic_warmup <= self.global_steps + 1
        kl_ctrl = self.kl_ctrl if kl_ctrl is None else kl_ctrl
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        mask = batch.response_mask

        # Independent forwards, side by side with one rank (rlmesh.learner.overlap_phases).
        forwards: dict[str, Callable[[], Any]] = {}
        reference = self.reference
        if reference is not None:  # colocated: always recomputed, whatever the batch carries
            forwards["ref"] = lambda: reference.log_probs(batch)
        if not self.bypass_mode:
            forwards["old_log_prob"] = lambda: self.compute_log_prob(batch)
        critic = self.critic
        if critic is not None:
            forwards["values"] = lambda: critic.compute_values(batch)
        done = self.phases.run(forwards)
        _record(timing, done)
        if "ref" in done:
            batch = dataclasses.replace(batch, ref_log_probs=done["ref"].result)
        if self.bypass_mode:  # the sampling policy's own log-probs; checked present by _check_batch
            old_log_probs = batch.rollout_log_probs
        else:
            old_log_probs, entropys = done["old_log_prob"].result
            # -norm: verl divides by loss_scale_factor, else by its padded width (the configured length).
            mode, norm_len = self.actor.config.loss_agg_mode, self.actor.norm_len
            metrics["actor/entropy"] = agg_loss(entropys, mask, mode, loss_scale_factor=norm_len).item()
        values = done["values"].result if "values" in done else None

        with self._timed(timing, "adv"):
            token_level_rewards = batch.token_level_scores
            if self.algo_cfg.use_kl_in_reward:
                if self._pending_kl_coef is not None:
                    kl_ctrl.value, self._pending_kl_coef = self._pending_kl_coef, None
                beta = kl_ctrl.value
                token_level_rewards, current_kl = apply_kl_penalty(
                    batch.token_level_scores, old_log_probs, batch.ref_log_probs, mask, kl_ctrl,
                    kl_penalty=self.algo_cfg.kl_penalty,
                )  # fmt: skip
                metrics["actor/reward_kl_penalty"] = current_kl
                metrics["actor/reward_kl_penalty_coeff"] = beta
            rollout_is_weights, corr_metrics = (
                (None, {}) if self.bypass_mode else self._rollout_correction(batch, old_log_probs)
            )
            metrics.update(corr_metrics)
            advantages, returns = compute_advantage(
                self.algo_cfg.adv_estimator,
                token_level_rewards,
                mask,
                values=values,
                index=batch.index,
                reward_baselines=batch.reward_baselines,
                gamma=self.algo_cfg.gamma,
                lam=self.algo_cfg.lam,
                norm_adv_by_std_in_grpo=self.algo_cfg.norm_adv_by_std_in_grpo,
            )

        updates: dict[str, Callable[[], dict[str, float]]] = {}
        if critic is not None:
            assert values is not None
            updates["update_critic"] = lambda: critic.update_critic(batch, values, returns, self.global_steps)
        if update_actor:
            updates["update_actor"] = lambda: self.actor.update_policy(
                batch, old_log_probs, advantages, rollout_is_weights, self.global_steps
            )
        done = self.phases.run(updates)
        _record(timing, done)
        for phase in done.values():
            metrics.update(phase.result)
        lengths = (self.max_response_length, self.max_prompt_length)
        metrics.update(batch_metrics(batch, token_level_rewards, advantages, returns, values, *lengths))
        # The learner's policy version: the first one plus a version per step (the loop pushes each).
        metrics.update(staleness_metrics(batch, self.first_version + self.global_steps))
        metrics.update(timing)
        metrics["training/skipped_steps"] = float(self.skipped_steps)
        metrics["training/actor_updated"] = float(update_actor)
        self.global_steps += 1
        return metrics

    def _check_batch(self, batch: PPOBatch) -> None:
        if len(batch) == 0:
            raise ValueError("train_step needs a non-empty batch")
        bad_score = ~torch.isfinite(batch.token_level_scores).all(dim=1)
        if bad_score.any():
            uid = batch.uids[int(bad_score.nonzero()[0])]
            raise BatchError(uid, "score", "not finite; refused before it reaches the loss")
        ids = batch.input_ids
        outside = (((ids >= self.vocab_size) | (ids < 0)) & batch.attention_mask.bool()).any(dim=1)
        if outside.any():
            uid = batch.uids[int(outside.nonzero()[0])]
            raise BatchError(uid, "token ids", f"outside the model's vocabulary of {self.vocab_size}")
        if self.bypass_mode and not batch.has_rollout_log_probs.all():
            uid = batch.uids[int((~batch.has_rollout_log_probs).nonzero()[0])]
            raise BatchError(
                uid,
                "rollout_log_probs",
                "required by algorithm.rollout_correction.bypass_mode (the old log-probs)",
            )
        needs_ref = self.algo_cfg.use_kl_in_reward or self.actor.config.use_kl_loss
        if needs_ref and batch.ref_log_probs is None and self.reference is None:
            raise BatchError(
                batch.uids[0], "ref_log_probs", "required by algorithm.use_kl_in_reward / actor.use_kl_loss"
            )
        if self.algo_cfg.adv_estimator == "remax":
            if batch.reward_baselines is None:
                raise BatchError(batch.uids[0], "baseline_score", "required by algorithm.adv_estimator=remax")
            bad = ~torch.isfinite(batch.reward_baselines)
            if bad.any():
                raise BatchError(batch.uids[int(bad.nonzero()[0])], "baseline_score", "not finite")

    def _rollout_correction(
        self, batch: PPOBatch, old_log_probs: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """IS weights (1 on rows without rollout log-probs), ``rollout_corr/*`` and
        ``training/rollout_logprob_abs_diff`` = mean |log π_rollout − log π_old| over valid tokens."""
        has = batch.has_rollout_log_probs
        if not has.any():
            return None, {}
        corr = self.algo_cfg.rollout_correction
        mask = batch.response_mask * has[:, None]
        weights, metrics = compute_rollout_correction(
            old_log_probs,
            batch.rollout_log_probs,
            mask,
            rollout_is=corr.rollout_is,
            rollout_is_threshold=corr.rollout_is_threshold,
            rollout_is_batch_normalize=corr.rollout_is_batch_normalize,
        )
        metrics["training/rollout_logprob_abs_diff"] = masked_mean(
            (batch.rollout_log_probs - old_log_probs).abs(), mask
        ).item()
        if weights is not None:
            weights = torch.where(has[:, None], weights, torch.ones_like(weights))
        return weights, metrics

    @contextmanager
    def _timed(self, timing: dict[str, float], name: str) -> Iterator[None]:
        """``timing_s/<name>``: seconds; ``timing_start/<name>``: when it began (``time.time()``),
        so a benchmark can place the learner's compute among other processes'."""
        wall, start = time.time(), time.perf_counter()
        yield
        timing[f"timing_s/{name}"] = time.perf_counter() - start
        timing[f"timing_start/{name}"] = wall

    # ------------------------------------------------------------------ control

    def update_hyperparams(
        self,
        *,
        actor_lr: float | None = None,
        critic_lr: float | None = None,
        entropy_coeff: float | None = None,
        kl_coef: float | None = None,
        kl_loss_coef: float | None = None,
        clip_ratio: float | None = None,
        temperature: float | None = None,
    ) -> None:
        """Change live hyper-parameters from the next step on: the actor's or the critic's peak lr,
        the entropy coefficient, the KL coefficient, the clip range or the temperature log-probs
        are computed at; the names are the live hyper-parameters' (``rlmesh.config.hparams``).
        ``kl_coef`` is the in-reward KL controller's coefficient (``algorithm.kl_ctrl.kl_coef``),
        set at the start of the next :meth:`train_step` (no effect without KL in the reward);
        ``kl_loss_coef`` is the KL loss's. ``clip_ratio`` sets both sides of the clip range
        (``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``). ``temperature`` is the sampling
        temperature of the samples the next steps train on (0, greedy, scores at 1 as at start)."""
        if actor_lr is not None:
            set_base_lr(self.actor.scheduler, float(actor_lr))
        if critic_lr is not None:
            if self.critic is None:
                raise ValueError("critic_lr: this trainer has no critic")
            set_base_lr(self.critic.scheduler, float(critic_lr))
        if entropy_coeff is not None:
            self.actor.entropy_coeff = float(entropy_coeff)
        if kl_coef is not None:
            self._pending_kl_coef = float(kl_coef)
        if kl_loss_coef is not None:
            self.actor.kl_loss_coef = float(kl_loss_coef)
        if clip_ratio is not None:
            eps = float(clip_ratio)
            self.actor.config = self.actor.config.model_copy(
                update={"clip_ratio": eps, "clip_ratio_low": eps, "clip_ratio_high": eps}
            )
        if temperature is not None:
            scoring = float(temperature) if temperature > 0 else 1.0
            self.actor.temperature = scoring
            if self.reference is not None:
                self.reference.model.temperature = scoring
        log.info(
            "hyperparameters updated: actor_lr=%s critic_lr=%s entropy_coeff=%s kl_coef=%s kl_loss_coef=%s "
            "clip_ratio=%s temperature=%s",
            actor_lr,
            critic_lr,
            entropy_coeff,
            kl_coef,
            kl_loss_coef,
            clip_ratio,
            temperature,
        )

    def actor_peak_lr(self) -> float:
        """The actor's peak learning rate now (``update_hyperparams`` changes it)."""
        return float(self.actor.scheduler.base_lrs[0])

    def critic_peak_lr(self) -> float | None:
        """The critic's peak learning rate now; None without a critic."""
        return None if self.critic is None else float(self.critic.scheduler.base_lrs[0])

    # ------------------------------------------------------------------ weights out

    def named_weights_for_push(
        self, bucket_bytes: int, copy: bool = True
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named actor weights (LoRA merged) in buckets of about ``bucket_bytes``.

        Collective under ZeRO-3 (every rank iterates to the end); rank 0 gets the tensors, the
        other ranks as many empty lists. ``copy=False``: each bucket valid only until the next is
        asked for (see ``iter_weight_buckets``).
        """
        engine = self.actor.engine
        zero3 = engine.zero_optimization_stage() == 3
        return iter_weight_buckets(
            engine.module, bucket_bytes, zero3=zero3, materialize=self.rank == 0, copy=copy
        )

    def greedy_generate(self, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """The actor's greedy continuation of each prompt, ending with the first eos when one is
        generated. Collective under ZeRO-3 with several ranks (same prompts on every rank)."""
        engine = self.actor.engine
        synced = engine.zero_optimization_stage() == 3 and self.dp_size > 1
        return greedy_generate(engine.module, prompt_ids, max_new_tokens, self.device, synced_gpus=synced)

    def export_hf(self, out_dir: str, tokenizer_path: str | None = None) -> None:
        """Write an HF directory (safetensors + config + tokenizer) of the actor, LoRA merged.
        Collective under ZeRO-3. The tokenizer comes from ``tokenizer_path``, default the run's."""
        buckets = self.named_weights_for_push(bucket_bytes=2 << 30)
        if self.rank == 0:
            hf = hf_model(self.actor.engine.module)
            write_hf_dir(
                out_dir,
                buckets,
                hf.config,
                hf.generation_config,
                tokenizer_path or self.config.tokenizer_path(),
            )
        else:
            for _ in buckets:  # take part in the gathers
                pass
        barrier()

    # ------------------------------------------------------------------ checkpoints

    def _engines(self) -> Engines:
        engines = [("actor", self.actor.engine, self.actor.scheduler)]
        if self.critic is not None:
            engines.append(("critic", self.critic.engine, self.critic.scheduler))
        return engines

    def save_checkpoint(self, path: str, extra_state: dict[str, Any], *, background: bool = False) -> None:
        """Save everything needed to resume into ``path``, atomically (``path.tmp-<pid>``, then
        ``COMPLETE``, then a rename; see :mod:`rlmesh.learner.checkpoints.store`). Collective: every rank
        calls it with the same arguments. ``background``: return once the state is copied into host
        memory, the files written meanwhile (:meth:`wait_for_checkpoint`; the next save waits too).

        Args:
            path: the checkpoint directory to create (replaced if it exists).
            extra_state: JSON-serialisable state of the caller (step, policy version, KL
                controller, data cursor, used uids ...), returned by :meth:`load_checkpoint`.
        """
        state = {
            "extra_state": extra_state,
            "global_steps": self.global_steps,
            "skipped_steps": {
                "actor": self.actor.skipped_steps,
                "critic": self.critic.skipped_steps if self.critic is not None else 0,
            },
            "hyperparams": {
                "entropy_coeff": self.actor.entropy_coeff,
                "kl_loss_coef": self.actor.kl_loss_coef,
                "pending_kl_coef": self._pending_kl_coef,
                "clip_ratio": self.actor.config.clip_ratio,
                "clip_ratio_low": self.actor.config.clip_ratio_low,
                "clip_ratio_high": self.actor.config.clip_ratio_high,
                "temperature": self.actor.temperature,
            },
            "kl_ctrl": self.kl_ctrl.state_dict(),
        }
        # A checkpoint is no place for secrets.
        writer = self.checkpoint_writer if background else None
        if writer is None:
            self.checkpoint_writer.wait()  # one in flight goes first: it is older
        save_checkpoint(path, self._engines(), state, self._config_yaml, writer)
        log.info("checkpoint %s: %s", "being written" if background else "saved", path)

    def wait_for_checkpoint(self) -> float:
        """Until the checkpoint being written in the background is complete (at once when none is);
        returns how long the last background write took, seconds."""
        self.checkpoint_writer.wait()
        return self.checkpoint_writer.written_s

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore actor/critic weights, optimizer and scheduler states, RNG states, the
        skipped-step counters, hyperparameters and the trainer's KL controller; returns the
        ``extra_state`` saved with them. Collective.

        Raises:
            CheckpointError: ``path`` is incomplete, or from a run with another world size or
                other ZeRO stages.
        """
        self.checkpoint_writer.wait()  # it may be the one being written
        state = load_checkpoint(path, self._engines())
        self.global_steps = int(state["global_steps"])
        self.actor.skipped_steps = int(state["skipped_steps"]["actor"])
        if self.critic is not None:
            self.critic.skipped_steps = int(state["skipped_steps"]["critic"])
        hp = state["hyperparams"]
        self.actor.entropy_coeff = float(hp["entropy_coeff"])
        self.actor.kl_loss_coef = float(hp["kl_loss_coef"])
        self._pending_kl_coef = hp["pending_kl_coef"]
        if "clip_ratio" in hp:  # set live (older checkpoints: the config's)
            self.actor.config = self.actor.config.model_copy(
                update={k: hp[k] for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")}
            )
        if "temperature" in hp:
            self.update_hyperparams(temperature=float(hp["temperature"]))
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        log.info("checkpoint loaded: %s", path)
        return state["extra_state"]


def _record(timing: dict[str, float], done: dict[str, Phase]) -> None:
    """``timing_s/<phase>`` and ``timing_start/<phase>`` of phases a :class:`PhaseRunner` ran."""
    for name, phase in done.items():
        timing[f"timing_s/{name}"] = phase.seconds
        timing[f"timing_start/{name}"] = phase.start
