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
        "a checkpoint always holds model, optimizer and extra state (rlmesh.learner.checkpoint)",
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
    ("actor_rollout_ref.model.custom_chat_template", "the tokenizer's own chat template is used"),
    ("actor_rollout_ref.model.exclude_modules", "LoRA adapts target_modules; exclusions are not supported"),
    ("actor_rollout_ref.model.lora_adapter_path", "LoRA training starts from fresh adapters"),
    ("actor_rollout_ref.actor.policy_loss.*", "policy_loss.loss_mode is 'vanilla': the other modes' knobs"),
    ("actor_rollout_ref.actor.tau_*", "the soft-gating (SAPO) policy loss is not implemented"),
    ("actor_rollout_ref.actor.loss_scale_factor", "losses are aggregated by loss_agg_mode only"),
    ("actor_rollout_ref.actor.calculate_entropy", "entropy is always computed (actor/entropy)"),
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
    ("actor_rollout_ref.rollout.*", SGLANG_ARGS),
    ("actor_rollout_ref.hybrid_engine", "the actor and the rollout are always separate services"),
    ("reward_model.model.use_remove_padding", "the reward model runs padded forwards"),
    ("reward_model.enable_resource_pool", "the reward service is placed by its deployment (compose, Ray)"),
    ("reward_model.n_gpus_per_node", "the reward service is placed by its deployment (compose, Ray)"),
    ("reward_model.nnodes", "the reward service is placed by its deployment (compose, Ray)"),
    ("reward_model.use_dynamic_bsz", "the reward model batches by micro_batch_size_per_gpu"),
    ("reward_model.forward_max_token_len_per_gpu", "the reward model batches by micro_batch_size_per_gpu"),
    (
        "reward_model.reward_manager",
        "the reward service scores each sample with one compute_score call, as "
        "verl's naive manager; the batch, prime and dapo managers are not implemented",
    ),
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
    ("algorithm.filter_groups", "DAPO's dynamic sampling is not implemented: every sampled group is trained"),
    ("trainer.rollout_data_dir", "trajectories are in Redis; export them with rlmesh export"),
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
