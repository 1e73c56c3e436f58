"""verl's other top-level sections: data, critic, reward_model, custom_reward_function, algorithm, trainer.

Keys and defaults follow verl's: docs/internals.md#rlmeshconfigactor_rollout_ref-and-rlmeshconfigsections"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from rlmesh.config.base import KLPenalty, LossAggMode, Section, Strategy, compat, strategy_field
from rlmesh.config.optim import (
    CriticOptimConfig,
    DeepSpeedConfig,
    EngineSettings,
    FsdpConfig,
    effective_engine,
)

AdvEstimator = Literal[
    "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gpg"
]
ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
# Estimators that compare samples of one prompt with each other: one sample per prompt is meaningless.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
Logger = Literal["console", "wandb", "mlflow", "tensorboard", "jsonl", "file"]


class DataConfig(Section):
    """Datasets and batch shapes (verl data/legacy_data.yaml)."""

    tokenizer: str | None = Field(None, description="tokenizer path; null = actor_rollout_ref.model.path")
    train_files: str | list[str] = Field(
        "~/data/rlhf/gsm8k/train.parquet", description="training parquet file(s)"
    )
    val_files: str | list[str] | None = Field(
        "~/data/rlhf/gsm8k/test.parquet", description="validation parquet file(s); null = no validation"
    )
    prompt_key: str = Field("prompt", description="column holding the chat prompt")
    reward_fn_key: str = Field("data_source", description="column that selects the reward function")
    max_prompt_length: int = Field(512, gt=0, description="max prompt tokens")
    max_response_length: int = Field(512, gt=0, description="max response tokens")
    train_batch_size: int = Field(
        1024, gt=0, description="prompts per PPO step (each sampled rollout.n times)"
    )
    val_batch_size: int | None = Field(
        None, gt=0, description="prompts per validation batch; null = all at once"
    )
    shuffle: bool = Field(True, description="shuffle the training set each epoch")
    seed: int | None = Field(None, description="seed of the training-set shuffle; null = unseeded")
    filter_overlong_prompts: bool = Field(False, description="drop prompts longer than max_prompt_length")
    truncation: Literal["error", "left", "right", "middle"] = Field(
        "error",
        description="what to do with a prompt over max_prompt_length: error, or cut left/right/middle",
    )
    train_max_samples: int = Field(-1, ge=-1, description="use at most this many training rows; -1 = all")
    val_max_samples: int = Field(-1, ge=-1, description="use at most this many validation rows; -1 = all")
    apply_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra keyword arguments for tokenizer.apply_chat_template"
    )
    use_sequence_packing: bool = Field(
        False,
        description="run every forward (actor, critic, reference, old log-probs) padding-free: turns on "
        "actor_rollout_ref.model.use_remove_padding and critic.model.use_remove_padding; refused "
        "together with actor_rollout_ref.model.use_remove_padding=false or "
        "actor_rollout_ref.actor.use_remove_padding=false",
    )
    use_shm: Any = compat(False)
    tool_config_path: Any = compat(None)
    return_raw_input_ids: Any = compat(False)
    return_raw_chat: Any = compat(True)
    return_full_prompt: Any = compat(False)
    dataloader_num_workers: Any = compat(8)
    image_patch_size: Any = compat(14)
    validation_shuffle: Any = compat(False)
    filter_overlong_prompts_workers: Any = compat(1)
    image_key: Any = compat("images")
    video_key: Any = compat("videos")
    trust_remote_code: Any = compat(False)
    custom_cls: Any = compat({"path": None, "name": None})
    return_multi_modal_inputs: Any = compat(True)
    sampler: Any = compat({"class_path": None, "class_name": None})
    datagen: Any = compat({"path": None, "name": None})
    gen_batch_size: Any = compat(None)
    function_tool_path: Any = compat(None)
    audio_key: Any = compat(None)
    mm_processor_kwargs: Any = compat({})


class CriticModelConfig(Section):
    """The value model (verl critic.model)."""

    path: str = Field("~/models/deepseek-llm-7b-chat", description="HF model id or local path of the critic")
    tokenizer_path: str | None = Field(
        None, description="tokenizer to load; null = actor_rollout_ref.model.path"
    )
    trust_remote_code: bool | None = Field(
        None, description="allow custom modelling code; null = actor_rollout_ref.model.trust_remote_code"
    )
    override_config: dict[str, Any] = Field(
        default_factory=dict, description="entries that override the model's HF config on load"
    )
    enable_gradient_checkpointing: bool = Field(
        True, description="recompute activations in backward to save memory"
    )
    lora_rank: int = Field(0, ge=0, description="LoRA rank; 0 = full fine-tuning")
    lora_alpha: int = Field(16, ge=1, description="LoRA alpha")
    target_modules: str | list[str] = Field("all-linear", description="LoRA target modules")
    fsdp_config: FsdpConfig = Field(default_factory=FsdpConfig, description="verl FSDP keys (offload, dtype)")
    use_remove_padding: bool = Field(
        False,
        description="run the critic's forwards padding-free (as actor_rollout_ref.model.use_remove_padding)",
    )
    external_lib: Any = compat(None)
    use_shm: Any = compat(False)
    enable_activation_offload: Any = compat(False)
    tiled_mlp: Any = compat({"enabled": False, "num_shards": 4})
    hf_config_path: Any = compat(None)
    custom_chat_template: Any = compat(None)
    exclude_modules: Any = compat(None)
    lora_adapter_path: Any = compat(None)
    use_liger: Any = compat(False)
    use_fused_kernels: Any = compat(False)
    fused_kernel_options: Any = compat({})
    mtp: Any = compat({})
    lora: Any = compat({})


class CriticConfig(Section):
    """PPO value function (verl critic/critic.yaml + critic/dp_critic.yaml)."""

    enable: bool | None = Field(
        None, description="train a critic; null = only when algorithm.adv_estimator is gae"
    )
    strategy: Strategy = strategy_field()
    optim: CriticOptimConfig = Field(default_factory=CriticOptimConfig, description="critic optimizer")
    model: CriticModelConfig = Field(default_factory=CriticModelConfig, description="value model")
    ppo_mini_batch_size: int | None = Field(
        None, gt=0, description="prompts per critic mini-batch; null = actor.ppo_mini_batch_size"
    )
    ppo_micro_batch_size_per_gpu: int | None = Field(
        None, gt=0, description="samples per forward/backward on one device; null = whole mini-batch"
    )
    use_dynamic_bsz: bool | None = Field(
        None, description="token-packed micro-batches; null = actor.use_dynamic_bsz"
    )
    ppo_max_token_len_per_gpu: int = Field(32768, gt=0, description="token budget of a packed micro-batch")
    forward_max_token_len_per_gpu: int | None = Field(
        None, gt=0, description="token budget of a packed value forward; null = ppo_max_token_len_per_gpu"
    )
    forward_micro_batch_size_per_gpu: int | None = Field(
        None, gt=0, description="samples per value forward; null = ppo_micro_batch_size_per_gpu"
    )
    ppo_epochs: int | None = Field(None, ge=1, description="passes over each batch; null = actor.ppo_epochs")
    shuffle: bool | None = Field(None, description="shuffle between epochs; null = actor.shuffle")
    cliprange_value: float = Field(0.5, ge=0, description="value clipping range")
    loss_agg_mode: LossAggMode | None = Field(
        None, description="loss aggregation; null = actor.loss_agg_mode"
    )
    grad_clip: float | None = Field(
        None,
        ge=0,
        description="max global gradient norm; 0 = no clipping; null = optim.clip_grad (verl's newer name "
        "for it; giving both with different values is an error), else 1.0",
    )
    deepspeed_config: DeepSpeedConfig = Field(
        default_factory=DeepSpeedConfig, description="DeepSpeed ZeRO settings"
    )
    rollout_n: Any = compat(1)
    ppo_micro_batch_size: Any = compat(None)
    forward_micro_batch_size: Any = compat(None)
    data_loader_seed: Any = compat(42)
    checkpoint: Any = compat({})
    profiler: Any = compat({})
    ulysses_sequence_parallel_size: Any = compat(1)
    megatron: Any = compat(None)
    fsdp: Any = compat({})
    loss_scale_factor: Any = compat(None)

    def effective_engine(self) -> EngineSettings:
        """ZeRO settings after mapping verl's critic.model.fsdp_config onto deepspeed_config."""
        return effective_engine(self.deepspeed_config, self.model.fsdp_config)


class RewardModelModelConfig(Section):
    """The reward model's weights."""

    path: str = Field(
        "~/models/FsfairX-LLaMA3-RM-v0.1", description="HF model id or local path of the reward model"
    )
    input_tokenizer: str | None = Field(
        None, description="tokenizer of the policy, to decode responses; null = actor_rollout_ref.model.path"
    )
    trust_remote_code: bool = Field(False, description="allow custom modelling code from the model repo")
    override_config: dict[str, Any] = Field(
        default_factory=dict, description="entries that override the HF config"
    )
    external_lib: Any = compat(None)
    use_shm: Any = compat(False)
    use_remove_padding: Any = compat(False)
    use_fused_kernels: Any = compat(False)
    fsdp_config: Any = compat({})


class OverlongBufferConfig(Section):
    """DAPO's overlong reward shaping (verl's recipe/dapo reward_model.overlong_buffer)."""

    enable: bool = Field(
        False,
        description="penalise responses longer than max_resp_len - len tokens (the dapo reward manager's)",
    )
    len: int = Field(
        0,
        ge=0,
        description="tokens before the response limit over which the penalty grows from 0 to penalty_factor; "
        "must be positive and at most the response limit when enabled",
    )
    penalty_factor: float = Field(0.0, description="the penalty at the response limit")
    log: bool = Field(
        False,
        description="also return overlong_reward and overlong (0 or 1) among each sample's reward extras",
    )


class RewardKwargsConfig(Section):
    """What verl's main trainer passes to its reward manager (``+reward_model.reward_kwargs.*``); the
    dapo manager's keys are known."""

    max_resp_len: int | None = Field(
        None,
        gt=0,
        description="the response limit the overlong penalty counts from; null = data.max_response_length",
    )
    overlong_buffer_cfg: OverlongBufferConfig = Field(
        default_factory=OverlongBufferConfig,
        description="the overlong penalty, as reward_model.overlong_buffer; when set (not all at the "
        "defaults), it is read instead",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("overlong_buffer_cfg", {}) is None:
            data = {k: v for k, v in data.items() if k != "overlong_buffer_cfg"}
        return data

    def given_overlong_buffer(self) -> OverlongBufferConfig | None:
        """overlong_buffer_cfg when the config set it (other than verl's defaults), else None."""
        return self.overlong_buffer_cfg if self.overlong_buffer_cfg != OverlongBufferConfig() else None


RewardManagerName = Literal["naive", "dapo"]
REWARD_MANAGERS: tuple[str, ...] = get_args(RewardManagerName)


class RewardModelConfig(Section):
    """A model-based reward (verl reward_model/*.yaml); rule-based rewards need none of it."""

    enable: bool = Field(False, description="score responses with a reward model")
    model: RewardModelModelConfig = Field(
        default_factory=RewardModelModelConfig, description="reward model weights"
    )
    micro_batch_size_per_gpu: int | None = Field(
        None, gt=0, description="samples per forward; null = whole batch"
    )
    max_length: int | None = Field(None, gt=0, description="max tokens scored per sample; null = no limit")
    reward_manager: RewardManagerName | None = Field(
        "naive",
        description="verl's reward manager: naive (the function's score as is) or dapo (records acc for a "
        "function that returns a number, every key of a dict, and adds the overlong penalty); batch and "
        "prime are refused; null = naive",
    )
    overlong_buffer: OverlongBufferConfig = Field(
        default_factory=OverlongBufferConfig, description="DAPO's overlong penalty (reward_manager=dapo)"
    )
    reward_kwargs: RewardKwargsConfig = Field(
        default_factory=RewardKwargsConfig,
        description="verl's main-trainer spelling of the dapo manager's settings",
    )
    enable_resource_pool: Any = compat(False)
    n_gpus_per_node: Any = compat(8)
    nnodes: Any = compat(0)
    strategy: Any = compat("fsdp")
    micro_batch_size: Any = compat(None)
    use_dynamic_bsz: Any = compat(False)
    forward_max_token_len_per_gpu: Any = compat(32768)
    reward_loop_source: Any = compat("register")
    reward_loop_module_path: Any = compat(None)
    reward_loop_class_name: Any = compat(None)
    launch_reward_fn_async: Any = compat(False)
    sandbox_fusion: Any = compat({})
    profiler: Any = compat({})
    ulysses_sequence_parallel_size: Any = compat(1)
    use_reward_loop: Any = compat(True)
    num_workers: Any = compat(1)
    rollout: Any = compat({})

    @field_validator("reward_manager", mode="before")
    @classmethod
    def _known_manager(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in REWARD_MANAGERS:
            raise ValueError(
                f"reward manager {value!r} is not implemented: the reward service calls the reward function "
                "once per sample, as verl's 'naive' manager (the default) does, or adds DAPO's overlong "
                "penalty too ('dapo'). A function written for verl's 'batch' manager must score one sample "
                "per call; for 'prime' use 'naive': the service already scores samples in parallel "
                "(rlmesh.reward.workers)"
            )
        return value

    @model_validator(mode="after")
    def _overlong_needs_dapo(self) -> RewardModelConfig:
        given = self.reward_kwargs.given_overlong_buffer()
        if given is not None and self.overlong_buffer.enable and given != self.overlong_buffer:
            raise ValueError(
                "reward_model.overlong_buffer and reward_model.reward_kwargs.overlong_buffer_cfg are two "
                "spellings of one setting and disagree: give one"
            )
        buffer = self.overlong()
        if buffer.enable and self.reward_manager != "dapo":
            raise ValueError(
                "the overlong penalty (overlong_buffer.enable) is the dapo reward manager's: set "
                f"reward_model.reward_manager=dapo (it is {self.reward_manager!r})"
            )
        if buffer.enable and buffer.len <= 0:
            raise ValueError(
                "reward_model.overlong_buffer.len must be positive when the overlong penalty is enabled; "
                "to turn it off, set overlong_buffer.enable=false"
            )
        limit = self.reward_kwargs.max_resp_len
        if buffer.enable and limit is not None and limit < buffer.len:
            raise ValueError(
                f"reward_model.reward_kwargs.max_resp_len ({limit}) must be at least the overlong buffer's "
                f"len ({buffer.len})"
            )
        return self

    def overlong(self) -> OverlongBufferConfig:
        """The overlong penalty's settings: reward_kwargs.overlong_buffer_cfg when given, else overlong_buffer."""
        given = self.reward_kwargs.given_overlong_buffer()
        return given if given is not None else self.overlong_buffer


class CustomRewardFunctionConfig(Section):
    """A user reward function loaded from a file."""

    path: str | None = Field(
        None, description="Python file holding the reward function; null = built-in rewards"
    )
    name: str = Field("compute_score", description="function name inside path")
    reward_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra keyword arguments for the function"
    )


class KLCtrlConfig(Section):
    """KL coefficient controller for the in-reward KL penalty."""

    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed or adaptive (Ziegler et al.) KL coefficient"
    )
    kl_coef: float = Field(0.001, ge=0, description="(initial) KL coefficient")
    horizon: int = Field(10000, gt=0, description="adaptive controller horizon")
    target_kl: float = Field(0.1, gt=0, description="adaptive controller target KL")


class RolloutCorrectionConfig(Section):
    """Importance-sampling correction for rollout/training mismatch and staleness."""

    rollout_is: Literal["token", "sequence"] | None = Field(
        None, description="IS weights at token or sequence level; null = none (metrics only)"
    )
    rollout_is_threshold: float = Field(2.0, gt=0, description="upper truncation of the IS weights")
    rollout_is_batch_normalize: bool = Field(False, description="rescale IS weights to mean 1 per batch")
    rollout_rs: None = Field(None, description="rejection sampling; not implemented in rlmesh, must be null")
    rollout_rs_threshold: Any = compat(None)
    rollout_rs_threshold_lower: Any = compat(None)
    rollout_token_veto_threshold: Any = compat(None)
    use_policy_gradient: Any = compat(False)
    bypass_mode: bool = Field(
        False,
        description="use the rollout's log-probs as the old log-probs and skip the actor's "
        "recompute pass (verl's bypass mode; TRL's PPO does the same): every trajectory must carry "
        "them. The IS correction then has nothing to correct and is off",
    )
    loss_type: Any = compat("ppo_clip")


# filter_groups.metric values that name the sequence reward rather than a reward extra.
SEQUENCE_REWARD_METRICS = ("reward", "seq_reward", "seq_final_reward")


class FilterGroupsConfig(Section):
    """DAPO's dynamic sampling (verl algorithm.filter_groups): groups that teach nothing are replaced."""

    enable: bool = Field(
        False,
        description="drop each prompt group whose metric is the same for all its samples (std 0; a group of "
        "one sample is kept) and draw new prompts in its place until data.train_batch_size groups are kept",
    )
    metric: str | None = Field(
        "reward",
        description="what a group is compared on: reward or seq_reward (the sequence score, the overlong "
        "penalty included), seq_final_reward (the same; refused with use_kl_in_reward), or a reward extra "
        "such as acc or score (reward_manager=dapo records acc for a function that returns a number)",
    )
    max_num_gen_batches: int = Field(
        0,
        description="fail the run when a step has drawn this many data.train_batch_size batches of prompts "
        "and still keeps too few groups (verl's error); <= 0 = no limit",
    )
    max_inflight_gen_batches: Any = compat(1)


class AlgorithmConfig(Section):
    """Advantage estimation and KL (verl ppo_trainer.yaml `algorithm`)."""

    adv_estimator: AdvEstimator = Field("gae", description="advantage estimator")
    gamma: float = Field(1.0, ge=0, le=1, description="discount factor")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda")
    norm_adv_by_std_in_grpo: bool = Field(True, description="divide GRPO advantages by the group std")
    use_kl_in_reward: bool = Field(False, description="subtract a KL penalty from the token rewards")
    kl_penalty: KLPenalty = Field("kl", description="KL estimator for the in-reward penalty")
    kl_ctrl: KLCtrlConfig = Field(default_factory=KLCtrlConfig, description="KL coefficient controller")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="off-policy importance-sampling correction"
    )
    use_pf_ppo: Literal[False] = Field(
        False, description="verl's preference-feedback PPO; not implemented, must be false"
    )
    pf_ppo: Any = compat({"reweight_method": "pow", "weight_pow": 2.0})
    filter_groups: FilterGroupsConfig = Field(
        default_factory=FilterGroupsConfig, description="DAPO's dynamic sampling"
    )

    @field_validator("filter_groups", mode="before")
    @classmethod
    def _no_filter_groups(cls, value: Any) -> Any:
        return {} if value is None else value  # verl's AlgoConfig default: null, i.e. off

    @model_validator(mode="after")
    def _filter_metric(self) -> AlgorithmConfig:
        fg = self.filter_groups
        if fg.enable and not fg.metric:
            raise ValueError("algorithm.filter_groups.metric must be set when group filtering is enabled")
        if fg.enable and fg.metric == "seq_final_reward" and self.use_kl_in_reward:
            raise ValueError(
                "algorithm.filter_groups.metric=seq_final_reward with use_kl_in_reward: the KL-penalised "
                "reward needs the learner's log-probs, which exist only once the batch is chosen; filter "
                "on seq_reward (the same reward before the KL penalty)"
            )
        return self


class TrainerConfig(Section):
    """Run length, checkpoints, validation and logging (verl ppo_trainer.yaml `trainer`)."""

    total_epochs: int = Field(30, ge=1, description="passes over the training set")
    total_training_steps: int | None = Field(
        None, gt=0, description="stop after this many steps; null = from epochs"
    )
    project_name: str = Field("verl_examples", description="experiment-tracker project")
    experiment_name: str = Field("gsm8k", description="experiment-tracker run name")
    logger: list[Logger] = Field(
        default_factory=lambda: ["console", "wandb"], description="metric sinks ('file' = jsonl, verl's name)"
    )
    log_val_generations: int = Field(0, ge=0, description="validation generations to log each validation")
    nnodes: int = Field(
        1,
        ge=1,
        description="nodes of the learner; > 1 is refused unless rlmesh.learner.ranks is set too (a "
        "multi-node learner runs under torchrun)",
    )
    n_gpus_per_node: int = Field(
        8,
        ge=0,
        description="GPUs of the learner per node: a config that sets it (>= 1) and not "
        "rlmesh.learner.ranks trains on this many ranks; rollout replicas hold GPUs of their own",
    )
    save_freq: int = Field(-1, ge=-1, description="checkpoint every this many steps; -1 = never")
    resume_mode: Literal["auto", "disable", "resume_path"] = Field(
        "auto",
        description="auto: latest checkpoint if any; disable: from scratch; resume_path: resume_from_path",
    )
    resume_from_path: str | None = Field(
        None, description="checkpoint to resume when resume_mode=resume_path"
    )
    val_before_train: bool = Field(True, description="validate once before the first step")
    val_only: bool = Field(
        False,
        description="validate the policy (the resumed checkpoint's, if any) once, log it at that step and "
        "exit without training; needs data.val_files (verl also needs val_before_train; rlmesh does not)",
    )
    test_freq: int = Field(-1, ge=-1, description="validate every this many steps; -1 = never")
    critic_warmup: int = Field(
        0,
        ge=0,
        description="verl's rule: the actor trains at step s only when critic_warmup <= s, so steps 1 to "
        "critic_warmup - 1 train only the critic (training/actor_updated = 0)",
    )
    default_local_dir: str = Field(
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}", description="checkpoint directory"
    )
    max_actor_ckpt_to_keep: int | None = Field(
        None,
        gt=0,
        description="newest checkpoints kept, older ones deleted; a step's directory holds actor and critic "
        "together (a resume needs both), so the larger of the two limits decides; null = all",
    )
    max_critic_ckpt_to_keep: int | None = Field(
        None, gt=0, description="as max_actor_ckpt_to_keep, for the critic (the larger limit decides)"
    )
    device: Literal["cuda", "cpu"] = Field(
        "cuda",
        description="device the learner trains on; cuda on a machine without one trains on the CPU with a "
        "warning; cpu stays off the GPUs",
    )
    balance_batch: bool = Field(
        True,
        description="give each learner rank an even share of the batch's tokens (verl's _balance_batch: "
        "same row counts, rows spread longest first); false = contiguous shares. One rank: no effect",
    )
    rollout_data_dir: Any = compat(None)
    validation_data_dir: Any = compat(None)
    esi_redundant_time: Any = compat(0)
    default_hdfs_dir: Any = compat(None)
    del_local_ckpt_after_load: Any = compat(False)
    ray_wait_register_center_timeout: Any = compat(300)
    use_legacy_worker_impl: Any = compat("auto")
    profile_steps: Any = compat(None)
    controller_nsight_options: Any = compat({})
    worker_nsight_options: Any = compat({})
    npu_profile: Any = compat({})
    use_v1: Any = compat(False)
    v1: Any = compat({})
    checkpoint_callback_class: Any = compat(None)

    @field_validator("logger", mode="before")
    @classmethod
    def _one_logger(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value
