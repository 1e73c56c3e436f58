"""Optimizer and training-engine sections shared by the actor and the critic.

docs/internals.md#rlmeshconfigoptim"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator

from rlmesh.config.base import DType, Section, compat


class OptimConfig(Section):
    """AdamW + LR schedule (verl's optim/fsdp.yaml), actor defaults."""

    lr: float = Field(1e-6, ge=0, description="learning rate")
    lr_warmup_steps_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        validation_alias=AliasChoices("lr_warmup_steps_ratio", "warmup_ratio"),
        description="warmup steps as a fraction of total training steps, used when lr_warmup_steps <= 0 "
        "(alias: warmup_ratio; giving both is an error)",
    )
    lr_warmup_steps: int | None = Field(
        -1,
        description="warmup steps; takes precedence when > 0 (null, 0 or negative: use lr_warmup_steps_ratio)",
    )
    lr_scheduler_type: Literal["constant", "cosine"] = Field(
        "constant", description="LR schedule after warmup: constant or cosine"
    )
    warmup_style: Literal["constant", "cosine"] | None = Field(
        None, description="deprecated verl name of lr_scheduler_type; when set it overrides lr_scheduler_type"
    )
    min_lr_ratio: float | None = Field(
        0.0, ge=0, le=1, description="cosine schedule floor as a fraction of lr"
    )
    num_cycles: float = Field(0.5, ge=0, description="number of cosine cycles over the schedule")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    optimizer: Any = compat("AdamW")
    optimizer_impl: Any = compat("torch.optim")
    total_training_steps: Any = compat(-1)
    clip_grad: float | None = Field(
        None,
        ge=0,
        description="max global gradient norm (verl's newer name for the role's grad_clip); null = that",
    )
    override_optimizer_config: Any = compat(None)
    zero_indexed_step: Any = compat(True)

    @model_validator(mode="before")
    @classmethod
    def _one_warmup_name(cls, data: Any) -> Any:
        # pydantic would silently take the first of two aliases; our issue's name and verl's
        # name for the same knob must not disagree quietly.
        if isinstance(data, dict) and "warmup_ratio" in data and "lr_warmup_steps_ratio" in data:
            raise ValueError(
                "give either 'warmup_ratio' or 'lr_warmup_steps_ratio' (the same setting), not both "
                f"(got warmup_ratio={data['warmup_ratio']!r}, lr_warmup_steps_ratio={data['lr_warmup_steps_ratio']!r})"
            )
        return data

    @model_validator(mode="after")
    def _apply_warmup_style(self) -> OptimConfig:
        # verl: a non-null warmup_style (deprecated) replaces lr_scheduler_type.
        if self.warmup_style is not None:
            self.lr_scheduler_type = self.warmup_style
        return self

    def warmup_steps(self, total_steps: int) -> int:
        """Warmup steps as verl computes them: lr_warmup_steps when > 0, else ratio * total."""
        if self.lr_warmup_steps is not None and self.lr_warmup_steps > 0:
            return self.lr_warmup_steps
        return int(self.lr_warmup_steps_ratio * total_steps)


class CriticOptimConfig(OptimConfig):
    """Same knobs as the actor's; verl's critic default lr is 1e-5."""

    lr: float = Field(1e-5, ge=0, description="learning rate")


class FsdpConfig(Section):
    """verl's FSDP engine section (engine/fsdp.yaml); only the offload flags and dtype mean something here."""

    param_offload: bool = Field(
        False,
        description="maps to deepspeed_config.offload_param (ZeRO-3 parameter CPU offload) unless that is set",
    )
    optimizer_offload: bool = Field(
        False,
        description="maps to deepspeed_config.offload_optimizer (ZeRO optimizer CPU offload) unless that is set",
    )
    dtype: DType = Field("bfloat16", description="compute dtype; used when deepspeed_config.dtype is null")
    wrap_policy: Any = compat({"min_num_params": 0})
    offload_policy: Any = compat(False)
    reshard_after_forward: Any = compat(True)
    fsdp_size: Any = compat(-1)
    forward_prefetch: Any = compat(False)
    model_dtype: Any = compat("fp32")
    use_orig_params: Any = compat(False)
    mixed_precision: Any = compat(None)
    seed: Any = compat(42)
    full_determinism: Any = compat(False)
    ulysses_sequence_parallel_size: Any = compat(1)
    entropy_from_logits_with_chunking: Any = compat(False)
    use_torch_compile: Any = compat(True)
    entropy_checkpointing: Any = compat(False)
    forward_only: Any = compat(False)
    strategy: Any = compat("fsdp")
    entropy_from_logits_chunk_size: Any = compat(2048)
    use_no_sync_for_gradient_accumulation: Any = compat(False)
    pad_to_length: Any = compat(None)
    pad_to_length_bucket: Any = compat(None)
    qat: Any = compat({})
    turbo_config: Any = compat({})


class RefFsdpConfig(FsdpConfig):
    """The reference model's FSDP section; verl marks it forward-only."""

    param_offload: bool = Field(
        False, description="keep the frozen reference weights on CPU between forwards"
    )
    forward_only: Any = compat(True)


class DeepSpeedConfig(Section):
    """rlmesh's own engine section: the DeepSpeed ZeRO settings the learner trains with."""

    zero_stage: int = Field(
        3,
        ge=0,
        le=3,
        description="ZeRO stage 0-3; 3 shards parameters, gradients and optimizer state like verl's FSDP",
    )
    offload_param: bool | None = Field(
        None, description="offload parameters to CPU (needs zero_stage 3); null = fsdp_config.param_offload"
    )
    offload_optimizer: bool | None = Field(
        None,
        description="offload optimizer state to CPU (needs zero_stage >= 1), stepped by DeepSpeed's CPU "
        "Adam on rlmesh.learner.optimizer_threads; null = fsdp_config.optimizer_offload",
    )
    dtype: DType | None = Field(None, description="training compute dtype; null = fsdp_config.dtype")


@dataclass(frozen=True)
class EngineSettings:
    """What the learner hands DeepSpeed: deepspeed_config merged with the verl fsdp_config it maps from."""

    zero_stage: int
    offload_param: bool
    offload_optimizer: bool
    dtype: str


def effective_engine(ds: DeepSpeedConfig, fsdp: FsdpConfig) -> EngineSettings:
    """deepspeed_config wins where set; otherwise verl's fsdp_config flag carries over."""
    return EngineSettings(
        zero_stage=ds.zero_stage,
        offload_param=fsdp.param_offload if ds.offload_param is None else ds.offload_param,
        offload_optimizer=fsdp.optimizer_offload if ds.offload_optimizer is None else ds.offload_optimizer,
        dtype=ds.dtype or fsdp.dtype,
    )
