"""The `actor_rollout_ref` section: policy model, actor training, rollout engine, reference policy.

Keys and defaults follow verl's: docs/internals.md#rlmeshconfigactor_rollout_ref-and-rlmeshconfigsections"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlmesh.config.base import (
    DType,
    KLPenalty,
    LossAggMode,
    Section,
    Strategy,
    compat,
    strategy_field,
)
from rlmesh.config.optim import (
    DeepSpeedConfig,
    EngineSettings,
    FsdpConfig,
    OptimConfig,
    RefFsdpConfig,
    effective_engine,
)

ROLLOUT_ENGINES = ("embedded", "sglang")


def check_chat_template(chat_template: str) -> None:
    """Compile ``chat_template`` as ``apply_chat_template`` will; raises ValueError on a Jinja
    syntax error (``actor_rollout_ref.model.custom_chat_template``)."""
    import jinja2

    try:
        # What apply_chat_template compiles with: transformers' sandbox, loop controls, {% generation %}.
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # a transformers without it: plain Jinja finds the same syntax errors
        compile_template = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).from_string
    try:
        compile_template(chat_template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"not a valid Jinja chat template: {e.message} (line {e.lineno})") from None


class ModelConfig(Section):
    """The policy model (actor, rollout and reference start from it)."""

    path: str = Field("~/models/deepseek-llm-7b-chat", description="HF model id or local path of the policy")
    tokenizer_path: str | None = Field(None, description="tokenizer to load; null = path")
    trust_remote_code: bool = Field(False, description="allow custom modelling code from the model repo")
    override_config: dict[str, Any] = Field(
        default_factory=dict, description="entries that override the model's HF config on load"
    )
    enable_gradient_checkpointing: bool = Field(
        True, description="recompute activations in backward to save memory"
    )
    lora_rank: int = Field(0, ge=0, description="LoRA rank; 0 = full fine-tuning")
    lora_alpha: int = Field(16, ge=1, description="LoRA alpha (scaling = alpha / rank)")
    target_modules: str | list[str] = Field(
        "all-linear", description="LoRA target modules: 'all-linear' or a list of module names"
    )
    use_remove_padding: bool = Field(
        True,
        description="run the actor's, the old log-probs' and the reference's forwards padding-free: "
        "each micro-batch's sequences back to back in rows no longer than its longest, per-sequence "
        "position ids, attention never crossing a sequence (verl's remove-padding; needs a "
        "llama/qwen2/qwen3 model on sdpa attention)",
    )
    custom_chat_template: str | None = Field(
        None,
        description="Jinja chat template that replaces the tokenizer's own wherever prompts are rendered "
        "(training and validation prompts); null = the tokenizer's",
    )
    lora_adapter_path: str | None = Field(
        None,
        description="PEFT LoRA adapter directory to start LoRA training from (LoRA on whatever lora_rank; "
        "its adapter_config.json sets rank, alpha and target modules); null = fresh adapters when lora_rank > 0",
    )
    hf_config_path: Any = compat(None)
    use_shm: Any = compat(False)
    external_lib: Any = compat(None)
    enable_activation_offload: Any = compat(False)
    exclude_modules: Any = compat(None)
    use_liger: Any = compat(False)
    use_fused_kernels: Any = compat(False)
    fused_kernel_options: Any = compat({"impl_backend": "torch"})
    tiled_mlp: Any = compat({"enabled": False, "num_shards": 4})
    mtp: Any = compat({})
    lora: Any = compat({})
    torch_dtype: Any = compat(None)

    @field_validator("custom_chat_template")
    @classmethod
    def _template_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            check_chat_template(value)
        return value


# verl's registered policy losses (rlmesh.algo.losses registers the same names).
PolicyLossMode = Literal[
    "vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro"
]


class PolicyLossConfig(Section):
    """verl's policy_loss section: which registered policy loss the actor trains with, and the
    knobs of the covariance and DRO losses
    (docs/algorithms.md#policy-loss-modes--actor_rollout_refactorpolicy_lossloss_mode)."""

    loss_mode: PolicyLossMode = Field(
        "vanilla",
        description="policy loss: vanilla (PPO clip + dual clip), gspo, sapo (actor.tau_pos/tau_neg), gpg, "
        "clip_cov, kl_cov, geo_mean (GMPO), cispo, dppo_tv, dppo_kl, dro (dro_beta)",
    )
    clip_cov_ratio: float = Field(
        0.0002, description="clip_cov: share of the tokens whose gradient is cut off"
    )
    clip_cov_lb: float = Field(1.0, description="clip_cov: lower bound of the covariance of a token cut off")
    clip_cov_ub: float = Field(5.0, description="clip_cov: upper bound of the covariance of a token cut off")
    kl_cov_ratio: float = Field(0.0002, description="kl_cov: share of the tokens given the KL penalty")
    ppo_kl_coef: float = Field(0.1, description="kl_cov: coefficient of the |log ratio| penalty")
    dro_beta: float | None = Field(
        None, description="dro: coefficient of the quadratic log-ratio penalty; must be > 0 for dro"
    )

    @field_validator("loss_mode", mode="before")
    @classmethod
    def _known_loss_mode(cls, value: Any) -> Any:
        if value == "bypass_mode":
            raise ValueError(
                "'bypass_mode' is the loss verl switches to itself under "
                "algorithm.rollout_correction.bypass_mode=true; set that key instead (with loss_mode vanilla, "
                "the PPO clip on the rollout's log-probs)"
            )
        return value

    @model_validator(mode="after")
    def _mode_knobs(self) -> PolicyLossConfig:
        # verl checks these when the loss runs; here at load, and only for the mode that reads them.
        if self.loss_mode == "clip_cov" and self.clip_cov_ratio <= 0:
            raise ValueError(f"loss_mode clip_cov needs clip_cov_ratio > 0 (got {self.clip_cov_ratio})")
        if self.loss_mode == "kl_cov" and self.kl_cov_ratio <= 0:
            raise ValueError(f"loss_mode kl_cov needs kl_cov_ratio > 0 (got {self.kl_cov_ratio})")
        if self.loss_mode == "dro" and (self.dro_beta is None or self.dro_beta <= 0):
            raise ValueError(f"loss_mode dro needs dro_beta > 0 (got {self.dro_beta})")
        return self


class ActorConfig(Section):
    """PPO actor training (verl actor/actor.yaml + actor/dp_actor.yaml)."""

    strategy: Strategy = strategy_field()
    ppo_mini_batch_size: int = Field(
        256, gt=0, description="prompts per PPO mini-batch (one optimizer step); times rollout.n samples"
    )
    ppo_micro_batch_size_per_gpu: int | None = Field(
        None, gt=0, description="samples per forward/backward on one device; null = whole mini-batch at once"
    )
    use_dynamic_bsz: bool = Field(
        False, description="pack micro-batches by token count instead of sample count"
    )
    ppo_max_token_len_per_gpu: int = Field(
        16384, gt=0, description="token budget of one packed micro-batch when use_dynamic_bsz"
    )
    use_remove_padding: bool | None = Field(
        None,
        description="padding-free micro-batches for the actor's training and old log-probs; "
        "null = actor_rollout_ref.model.use_remove_padding",
    )
    clip_ratio: float = Field(0.2, ge=0, description="PPO clip range epsilon")
    clip_ratio_low: float | None = Field(
        0.2, ge=0, description="lower clip epsilon (1 - low); null = clip_ratio"
    )
    clip_ratio_high: float | None = Field(
        0.2, ge=0, description="upper clip epsilon (1 + high); null = clip_ratio"
    )
    clip_ratio_c: float = Field(
        3.0, gt=1, description="dual-clip constant C (> 1) bounding the loss when A < 0"
    )
    loss_agg_mode: LossAggMode = Field(
        "token-mean", description="how per-token losses are averaged into one loss"
    )
    entropy_coeff: float = Field(0.0, description="entropy bonus coefficient in the policy loss")
    use_kl_loss: bool = Field(False, description="add KL(actor || reference) to the loss (GRPO style)")
    kl_loss_coef: float = Field(0.001, ge=0, description="coefficient of the KL loss")
    kl_loss_type: KLPenalty = Field("low_var_kl", description="KL estimator for the KL loss")
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch of rollouts")
    shuffle: bool = Field(False, description="shuffle samples between PPO epochs")
    grad_clip: float | None = Field(
        None,
        ge=0,
        description="max global gradient norm; 0 = no clipping; null = optim.clip_grad (verl's newer name "
        "for it; giving both with different values is an error), else 1.0",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="actor optimizer")
    fsdp_config: FsdpConfig = Field(default_factory=FsdpConfig, description="verl FSDP keys (offload, dtype)")
    deepspeed_config: DeepSpeedConfig = Field(
        default_factory=DeepSpeedConfig, description="DeepSpeed ZeRO settings"
    )
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig, description="policy loss variant")
    ppo_micro_batch_size: Any = compat(None)
    rollout_n: Any = compat(1)
    tau_pos: float = Field(
        1.0, gt=0, description="sapo: gate temperature of tokens with a positive advantage"
    )
    tau_neg: float = Field(
        1.05, gt=0, description="sapo: gate temperature of the other tokens (> tau_pos: softer on negatives)"
    )
    freeze_vision_tower: Any = compat(False)
    loss_scale_factor: int | None = Field(
        None,
        gt=0,
        description="the constant seq-mean-token-sum-norm divides by; null = the response length "
        "(data.max_response_length)",
    )
    calculate_entropy: bool = Field(False, description="log actor/entropy_loss also when entropy_coeff is 0")
    use_prefix_grouper: Any = compat(False)
    use_torch_compile: Any = compat(True)
    data_loader_seed: int = Field(
        42, description="seed of the shuffle between PPO epochs (actor.shuffle) and of the mini-batch order"
    )
    checkpoint: Any = compat({})
    use_fused_kernels: Any = compat(False)
    profiler: Any = compat({})
    router_replay: Any = compat({})
    ulysses_sequence_parallel_size: Any = compat(1)
    entropy_from_logits_with_chunking: Any = compat(False)
    entropy_checkpointing: Any = compat(False)
    calculate_sum_pi_squared: Any = compat(False)
    sum_pi_squared_checkpointing: Any = compat(False)
    megatron: Any = compat(None)
    qat: Any = compat({})
    entropy_from_logits_chunk_size: Any = compat(2048)
    pad_to_length: Any = compat(None)

    def effective_engine(self) -> EngineSettings:
        """ZeRO stage, offload flags and dtype after mapping verl's fsdp_config onto deepspeed_config."""
        return effective_engine(self.deepspeed_config, self.fsdp_config)


class ValKwargs(Section):
    """Sampling for validation generations."""

    top_k: int = Field(-1, ge=-1, description="top-k for validation; -1 or 0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling p for validation")
    temperature: float = Field(0.0, ge=0, description="sampling temperature for validation")
    n: int = Field(1, ge=1, description="samples per validation prompt")
    do_sample: bool = Field(False, description="sample during validation; false = greedy")


class SglangConfig(Section):
    """How the rollout service reaches SGLang (rollout.name=sglang)."""

    url: list[str] = Field(
        default_factory=list, description="attach to these running SGLang servers; empty = launch one"
    )
    extra_args: list[str] = Field(
        default_factory=list, description="extra command-line arguments for a launched sglang.launch_server"
    )

    @field_validator("url", mode="before")
    @classmethod
    def _one_url(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class RolloutConfig(Section):
    """Generation (verl rollout/rollout.yaml)."""

    name: Literal["embedded", "sglang"] = Field(
        "embedded",
        description="rollout engine: 'embedded' (CPU, HF transformers) or 'sglang' (GPU); not set (or "
        "verl's vllm/trtllm): sglang where a CUDA GPU is, else embedded; verl's hf: embedded",
    )
    n: int = Field(1, ge=1, description="responses sampled per prompt (> 1 for grpo/rloo)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature")
    top_k: int = Field(-1, ge=-1, description="top-k sampling; -1 or 0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling p")
    do_sample: bool = Field(True, description="sample; false = greedy")
    prompt_length: int | None = Field(
        None, gt=0, description="max prompt tokens; null = data.max_prompt_length"
    )
    response_length: int | None = Field(
        None, gt=0, description="max generated tokens; null = data.max_response_length"
    )
    dtype: DType = Field("bfloat16", description="inference weights dtype")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU memory fraction SGLang may use")
    tensor_model_parallel_size: int = Field(2, ge=1, description="tensor-parallel size of one SGLang server")
    ignore_eos: bool = Field(False, description="keep generating past EOS")
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        None, gt=0, description="samples per forward when recomputing log-probs; null = whole batch"
    )
    log_prob_use_dynamic_bsz: bool | None = Field(
        None, description="token-packed log-prob batches; null = actor.use_dynamic_bsz"
    )
    log_prob_max_token_len_per_gpu: int | None = Field(
        None,
        gt=0,
        description="token budget of a packed log-prob batch; null = actor.ppo_max_token_len_per_gpu",
    )
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs, description="sampling for validation")
    sglang: SglangConfig = Field(default_factory=SglangConfig, description="SGLang server settings")
    mode: Any = compat("async")
    enforce_eager: bool = Field(False, description="sglang: no CUDA graphs (--disable-cuda-graph)")
    cudagraph_capture_sizes: Any = compat(None)
    free_cache_engine: Any = compat(True)
    data_parallel_size: Any = compat(1)
    expert_parallel_size: Any = compat(1)
    pipeline_model_parallel_size: Any = compat(1)
    max_num_batched_tokens: int = Field(
        8192,
        gt=0,
        description="sglang: tokens per prefill chunk (--chunked-prefill-size), vLLM's batch token budget",
    )
    max_model_len: int | None = Field(
        None, gt=0, description="sglang: context length (--context-length); null = the model's"
    )
    max_num_seqs: int = Field(256, gt=0, description="sglang: requests run at once (--max-running-requests)")
    enable_chunked_prefill: bool = Field(
        True, description="sglang: chunked prefill; false = --chunked-prefill-size -1"
    )
    enable_prefix_caching: bool = Field(
        True, description="sglang: prefix (radix) cache; false = --disable-radix-cache"
    )
    logprobs_mode: Any = compat("processed_logprobs")
    scheduling_policy: Any = compat("fcfs")
    load_format: Any = compat("dummy")
    log_prob_micro_batch_size: Any = compat(None)
    disable_log_stats: Any = compat(True)
    over_sample_rate: Any = compat(0)
    multi_stage_wake_up: Any = compat(False)
    engine_kwargs: dict[str, Any] = Field(
        default_factory=lambda: {"vllm": {}, "sglang": {}, "trtllm": {}},
        description="engine_kwargs.sglang: ServerArgs entries passed to SGLang as --flags (name: value; "
        "true = the bare flag); the vllm/trtllm entries are refused when not empty",
    )
    multi_turn: Any = compat({})
    calculate_log_probs: Any = compat(False)
    agent: Any = compat({})
    checkpoint_engine: Any = compat({})
    trace: Any = compat({})
    skip_rollout: Any = compat(False)
    skip_dump_dir: Any = compat("/tmp/rollout_dump")
    skip_tokenizer_init: bool = Field(
        True,
        description="sglang: start the server without a tokenizer (token ids in and out; it then refuses "
        "stop strings and min_new_tokens); replicas decode the response text themselves",
    )
    enable_rollout_routing_replay: Any = compat(False)
    profiler: Any = compat({})
    prometheus: Any = compat({})
    quantization: Any = compat(None)
    quantization_config_file: Any = compat(None)
    mtp: Any = compat(None)
    layered_summon: Any = compat(False)
    nnodes: Any = compat(0)
    n_gpus_per_node: Any = compat(8)
    full_determinism: Any = compat(False)
    seed: Any = compat(42)
    router_config_path: Any = compat(None)
    moe_load_balance_metrics_interval: Any = compat(0)
    qat: Any = compat({})
    disaggregation: Any = compat({})

    @field_validator("name", mode="before")
    @classmethod
    def _known_engine(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ROLLOUT_ENGINES:
            hint = (
                " (load the config with rlmesh, which maps verl's engines onto these)"
                if value in ("vllm", "hf", "trtllm")
                else ""
            )
            raise ValueError(
                f"rollout engine {value!r} is not supported{hint}; supported: 'embedded' (CPU, HF transformers) "
                "and 'sglang' (GPU)"
            )
        return value


class RefConfig(Section):
    """The frozen reference policy (verl ref/ref.yaml + ref/dp_ref.yaml)."""

    log_prob_micro_batch_size_per_gpu: int | None = Field(
        None, gt=0, description="samples per reference forward; null = whole batch"
    )
    log_prob_use_dynamic_bsz: bool | None = Field(
        None, description="token-packed reference batches; null = actor.use_dynamic_bsz"
    )
    log_prob_max_token_len_per_gpu: int | None = Field(
        None,
        gt=0,
        description="token budget of a packed reference batch; null = actor.ppo_max_token_len_per_gpu",
    )
    fsdp_config: RefFsdpConfig = Field(
        default_factory=RefFsdpConfig, description="verl FSDP keys (param_offload)"
    )
    strategy: Any = compat("fsdp")
    rollout_n: Any = compat(1)
    use_torch_compile: Any = compat(True)
    log_prob_micro_batch_size: Any = compat(None)
    profiler: Any = compat({})
    router_replay: Any = compat({})
    ulysses_sequence_parallel_size: Any = compat(1)
    entropy_from_logits_with_chunking: Any = compat(False)
    entropy_checkpointing: Any = compat(False)
    megatron: Any = compat(None)
    model: Any = compat(None)
    entropy_from_logits_chunk_size: Any = compat(2048)
    pad_to_length: Any = compat(None)


class ActorRolloutRefConfig(Section):
    """verl's combined worker section."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="policy model")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="PPO actor")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="generation")
    ref: RefConfig = Field(default_factory=RefConfig, description="reference policy")
    hybrid_engine: Any = compat(True)
    profiler: Any = compat({})
    nccl_timeout: float = Field(
        600,
        gt=0,
        description="how long a collective of the learner's ranks (NCCL or gloo) waits for the others "
        "before it fails, seconds",
    )
