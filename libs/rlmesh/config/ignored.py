"""verl keys rlmesh accepts but does not act on, each with the reason; the loader names the ones a
config sets in one warning (docs/config.md#keys-rlmesh-ignores)."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable
from typing import Any

SGLANG_ARGS = (
    "an inference-server option: give SGLang's own flag in actor_rollout_ref.rollout.sglang.extra_args"
)
DEEPSPEED = (
    "rlmesh trains every role with DeepSpeed ZeRO (deepspeed_config); fsdp_config's offload flags and "
    "dtype carry over, its other keys have no DeepSpeed counterpart"
)
KERNELS = "a kernel or compiler switch of verl's FSDP workers; rlmesh runs the HF model's own modules"
NO_SP = (
    "rlmesh has no sequence parallelism; use_dynamic_bsz and sequence packing bound the tokens per forward"
)
DEPRECATED_MICRO = "verl's deprecated global micro-batch size; rlmesh reads the *_per_gpu key"
PROFILER = "no built-in profiler hooks; every service exports Prometheus metrics and timing_s/* per step"
MULTIMODAL = "rlmesh trains text-only models"
LAUNCHER = "verl's Ray/Hydra launcher setting; rlmesh starts its services itself (rlmesh train, compose, Ray)"
SHM = "models load from their path; there is no shared-memory copy"
DERIVED = "verl fills it in itself from other keys; rlmesh derives the same value"

# Ordered: the first pattern that matches a dotted key gives its reason.
IGNORED: tuple[tuple[str, str], ...] = (
    ("*.strategy", DEEPSPEED),
    ("*.fsdp_config.*", DEEPSPEED),
    ("reward_model.model.fsdp_config", DEEPSPEED),
    ("*.megatron", "rlmesh trains with DeepSpeed ZeRO, not Megatron"),
    (
        "*.optim.optimizer",
        "the optimizer is always torch AdamW (DeepSpeed's CPU Adam with optimizer offload)",
    ),
    (
        "*.optim.optimizer_impl",
        "the optimizer is always torch AdamW (DeepSpeed's CPU Adam with optimizer offload)",
    ),
    (
        "*.optim.override_optimizer_config",
        "the optimizer is always torch AdamW with lr, betas and weight_decay",
    ),
    ("*.optim.total_training_steps", DERIVED + " (trainer.total_training_steps or the epochs)"),
    ("*.ulysses_sequence_parallel_size", NO_SP),
    ("*.profiler", PROFILER),
    ("global_profiler", PROFILER),
    ("*.use_torch_compile", KERNELS),
    ("*.use_fused_kernels", KERNELS),
    ("*.fused_kernel_options", KERNELS),
    ("*.use_liger", KERNELS),
    ("*.entropy_from_logits_with_chunking", KERNELS),
    ("*.entropy_checkpointing", KERNELS),
    ("*.entropy_from_logits_chunk_size", KERNELS),
    ("*.pad_to_length", "micro-batches are padded to their longest row, or packed (use_remove_padding)"),
    ("*.qat", "quantisation-aware training is not implemented (qat.enable must be false)"),
    (
        "*.optim.zero_indexed_step",
        "the learning-rate schedule counts optimizer steps from 0, as verl's default",
    ),
    ("*.tiled_mlp", KERNELS),
    ("*.enable_activation_offload", "activation memory is bounded by enable_gradient_checkpointing only"),
    ("*.use_shm", SHM),
    ("*.external_lib", "custom modelling code loads through trust_remote_code only"),
    ("*.rollout_n", DERIVED + " (actor_rollout_ref.rollout.n)"),
    ("*.ppo_micro_batch_size", DEPRECATED_MICRO),
    ("*.forward_micro_batch_size", DEPRECATED_MICRO),
    ("*.log_prob_micro_batch_size", DEPRECATED_MICRO),
    ("reward_model.micro_batch_size", DEPRECATED_MICRO),
    ("*.data_loader_seed", "the prompt order is data.seed's (a resumable cursor), not a data-loader seed"),
    (
        "*.checkpoint",
        "a checkpoint always holds model, optimizer and extra state (rlmesh.learner.checkpoints.store)",
    ),
    ("*.router_replay", "mixture-of-experts routing replay is not implemented"),
    ("*.mtp", "multi-token prediction is not implemented"),
    ("data.image_*", MULTIMODAL),
    ("data.video_key", MULTIMODAL),
    ("data.return_multi_modal_inputs", MULTIMODAL),
    ("actor_rollout_ref.actor.freeze_vision_tower", MULTIMODAL),
    ("data.tool_config_path", "multi-turn tool use is not implemented"),
    ("actor_rollout_ref.rollout.multi_turn", "multi-turn tool use is not implemented"),
    ("actor_rollout_ref.rollout.agent", "agent loops are not implemented; a replica generates one turn"),
    ("data.return_raw_*", "a trajectory always carries the prompt text and ids"),
    ("data.return_full_prompt", "a trajectory always carries the prompt text and ids"),
    ("data.dataloader_num_workers", "the learner reads prompts from Parquet itself; there is no data loader"),
    ("data.filter_overlong_prompts_workers", "prompts are filtered in the learner's process"),
    ("data.validation_shuffle", "validation always runs every prompt in file order"),
    ("data.trust_remote_code", "the tokenizer loads with actor_rollout_ref.model.trust_remote_code"),
    ("data.custom_cls", "datasets are verl's Parquet layout; custom dataset classes are not loaded"),
    ("data.sampler", "the prompt order is data.shuffle with data.seed; custom samplers are not loaded"),
    ("data.datagen", "dynamic data generation is not implemented"),
    ("actor_rollout_ref.model.hf_config_path", "the HF config loads from actor_rollout_ref.model.path"),
    ("actor_rollout_ref.model.exclude_modules", "LoRA adapts target_modules; exclusions are not supported"),
    ("actor_rollout_ref.actor.use_prefix_grouper", "shared-prompt forwards are not implemented"),
    ("actor_rollout_ref.actor.*sum_pi_squared*", "not implemented"),
    ("actor_rollout_ref.rollout.mode", "replicas always generate asynchronously, each a service of its own"),
    (
        "actor_rollout_ref.rollout.load_format",
        "replicas start from actor_rollout_ref.model.path, then get "
        "the learner's weights by rlmesh.weight_sync",
    ),
    ("actor_rollout_ref.rollout.free_cache_engine", "replicas never share a device with the learner"),
    ("actor_rollout_ref.rollout.multi_stage_wake_up", "replicas never share a device with the learner"),
    ("actor_rollout_ref.rollout.layered_summon", "replicas never share a device with the learner"),
    ("actor_rollout_ref.rollout.checkpoint_engine", "weights move by rlmesh.weight_sync"),
    ("actor_rollout_ref.rollout.data_parallel_size", "scale with rlmesh.rollout.replicas"),
    ("actor_rollout_ref.rollout.over_sample_rate", "not implemented: every sampled group is trained"),
    ("actor_rollout_ref.rollout.calculate_log_probs", "replicas always return their sampling log-probs"),
    ("actor_rollout_ref.rollout.skip_*", "not implemented: every step generates"),
    ("actor_rollout_ref.rollout.trace", "not implemented; the services log and export metrics"),
    ("actor_rollout_ref.rollout.prometheus", "every replica exports Prometheus metrics itself"),
    (
        "actor_rollout_ref.rollout.enable_rollout_routing_replay",
        "mixture-of-experts routing replay is not implemented",
    ),
    ("actor_rollout_ref.rollout.quantization*", "replicas generate in actor_rollout_ref.rollout.dtype"),
    ("actor_rollout_ref.rollout.nnodes", "replicas are placed by rlmesh.rollout.replicas and the deployment"),
    (
        "actor_rollout_ref.rollout.n_gpus_per_node",
        "replicas are placed by rlmesh.rollout.replicas and the deployment",
    ),
    ("actor_rollout_ref.rollout.full_determinism", "each replica seeds its own engine (rlmesh.sampler)"),
    ("actor_rollout_ref.rollout.seed", "each replica seeds its own engine (rlmesh.sampler)"),
    (
        "actor_rollout_ref.rollout.router_config_path",
        "requests go to replicas through the prompt stream, not a router",
    ),
    (
        "actor_rollout_ref.rollout.moe_load_balance_metrics_interval",
        "mixture-of-experts metrics are not exported",
    ),
    (
        "actor_rollout_ref.rollout.disaggregation",
        "prefill/decode disaggregation: start SGLang with it and attach (disaggregation.enabled must be false)",
    ),
    ("actor_rollout_ref.rollout.*", SGLANG_ARGS),
    ("actor_rollout_ref.hybrid_engine", "the actor and the rollout are always separate services"),
    (
        "actor_rollout_ref.model.lora",
        "Megatron's LoRA settings (lora.rank must be 0): rlmesh's LoRA reads model.lora_rank, lora_alpha, "
        "target_modules and lora_adapter_path",
    ),
    (
        "actor_rollout_ref.model.torch_dtype",
        "the actor trains float32 master weights under DeepSpeed (fsdp_config.dtype / deepspeed_config); "
        "replicas generate in rollout.dtype",
    ),
    (
        "actor_rollout_ref.ref.model",
        "the reference policy is actor_rollout_ref.model.path (ref.model must be null)",
    ),
    ("critic.model.hf_config_path", "the HF config loads from critic.model.path"),
    ("critic.model.custom_chat_template", "the critic scores the prompts the learner rendered"),
    ("critic.model.exclude_modules", "LoRA adapts target_modules; exclusions are not supported"),
    (
        "critic.model.lora_adapter_path",
        "the critic starts from critic.model.path (fresh LoRA adapters when lora_rank > 0)",
    ),
    (
        "critic.model.lora",
        "Megatron's LoRA settings (lora.rank must be 0): the critic's LoRA reads lora_rank",
    ),
    (
        "critic.fsdp",
        DEEPSPEED + " (critic.fsdp.param_offload / optimizer_offload are read as critic.model.fsdp_config's)",
    ),
    ("critic.loss_scale_factor", "the value loss is aggregated by critic.loss_agg_mode"),
    ("data.gen_batch_size", "dynamic sampling refills a step group by group from the prompt stream"),
    ("data.function_tool_path", "multi-turn tool use is not implemented"),
    ("data.audio_key", MULTIMODAL),
    ("data.mm_processor_kwargs", MULTIMODAL),
    (
        "algorithm.rollout_correction.rollout_rs_threshold_lower",
        "rejection sampling is not implemented (must be null)",
    ),
    (
        "algorithm.rollout_correction.rollout_token_veto_threshold",
        "the token veto is not implemented (must be null)",
    ),
    (
        "algorithm.rollout_correction.use_policy_gradient",
        "the policy loss is policy_loss.loss_mode's (must be false; loss_mode=gpg is the plain policy gradient)",
    ),
    ("trainer.profile_steps", PROFILER),
    ("trainer.*_nsight_options", PROFILER),
    ("trainer.npu_profile", PROFILER),
    ("trainer.use_v1", "verl's trainer implementation switch; rlmesh has one trainer"),
    (
        "trainer.v1",
        "verl's v1 trainer modes (trainer_mode must be sync): rlmesh's async is rlmesh.max_staleness",
    ),
    (
        "trainer.checkpoint_callback_class",
        "checkpoint callbacks are not loaded; checkpoints follow save_freq",
    ),
    ("ray_init", LAUNCHER),
    (
        "reward",
        "verl >= 0.8's reward section: its custom_reward_function, reward_manager.name, reward_kwargs, "
        "reward_model.enable and model_path are read as the older reward_model / custom_reward_function "
        "keys; the rest place verl's reward workers",
    ),
    ("distillation", "on-policy distillation is not implemented (distillation.enabled must be false)"),
    ("skip", "skipping (replaying) rollouts is not implemented"),
    ("reward_model.model.use_remove_padding", "the reward model runs padded forwards"),
    ("reward_model.enable_resource_pool", "the reward service is placed by its deployment (compose, Ray)"),
    ("reward_model.n_gpus_per_node", "the reward service is placed by its deployment (compose, Ray)"),
    ("reward_model.nnodes", "the reward service is placed by its deployment (compose, Ray)"),
    ("reward_model.use_dynamic_bsz", "the reward model batches by micro_batch_size_per_gpu"),
    ("reward_model.forward_max_token_len_per_gpu", "the reward model batches by micro_batch_size_per_gpu"),
    (
        "reward_model.reward_loop_*",
        "rewards come from the reward service (custom_reward_function or a model)",
    ),
    (
        "reward_model.use_reward_loop",
        "rewards come from the reward service (custom_reward_function or a model)",
    ),
    ("reward_model.launch_reward_fn_async", "the reward service always scores concurrently with generation"),
    ("reward_model.num_workers", "scale with more reward service processes (rlmesh.reward)"),
    (
        "reward_model.sandbox_fusion",
        "code-execution rewards are not built in; write a custom_reward_function",
    ),
    ("reward_model.rollout", "a generative reward model is not implemented"),
    ("algorithm.rollout_correction.rollout_rs_threshold", "rejection sampling is not implemented"),
    (
        "algorithm.rollout_correction.loss_type",
        "the policy loss is the clipped surrogate (policy_loss.loss_mode)",
    ),
    ("algorithm.pf_ppo", "preference-feedback PPO is not implemented (algorithm.use_pf_ppo must be false)"),
    (
        "algorithm.filter_groups.max_inflight_gen_batches",
        "dynamic sampling draws one new prompt per dropped group as it is dropped: a step never has more "
        "than data.train_batch_size prompts in flight",
    ),
    (
        "trainer.rollout_data_dir",
        "trajectories live in Redis streams (rlmesh.queue); none are written to files",
    ),
    ("trainer.validation_data_dir", "use trainer.log_val_generations"),
    ("trainer.esi_redundant_time", "checkpoints are taken by save_freq and on SIGTERM"),
    ("trainer.default_hdfs_dir", "checkpoints go to trainer.default_local_dir only"),
    ("trainer.del_local_ckpt_after_load", "checkpoints are kept by max_actor_ckpt_to_keep"),
    ("trainer.ray_wait_register_center_timeout", LAUNCHER),
    ("trainer.use_legacy_worker_impl", LAUNCHER),
    ("defaults", LAUNCHER),
    ("hydra", LAUNCHER),
    ("ray_kwargs", LAUNCHER),
    ("transfer_queue", "trajectories move through Redis streams (rlmesh.queue)"),
    ("reward_manager", "rewards come from the reward service (custom_reward_function or a model)"),
)


def ignored_reason(key: str) -> str | None:
    """Why rlmesh ignores ``key`` (a dotted leaf), or None when it acts on it."""
    for pattern, why in IGNORED:
        if fnmatch.fnmatchcase(key, pattern):
            return why
    return None


def ignored_given(given: Iterable[str], values: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """``(key, value, why)`` for each ignored leaf among ``given`` (the dotted paths a config
    writes), sorted; ``values`` maps a leaf to the value it loaded with."""
    return sorted(
        (key, values.get(key), why)
        for key in set(given)
        if key in values and (why := ignored_reason(key)) is not None
    )


def ignored_message(items: list[tuple[str, Any, str]]) -> str:
    """The one start-up warning: every ignored key the config sets, with its value and why."""
    lines = [f"{len(items)} verl key(s) set here are accepted but ignored by rlmesh:"]
    lines += [f"  {key}={_show(value)}: {why}" for key, value, why in items]
    return "\n".join(lines)


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
