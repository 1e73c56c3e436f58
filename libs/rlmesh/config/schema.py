"""The root of the config tree; derived keys (verl's interpolations) are filled in here.

docs/internals.md#rlmeshconfigschema"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, model_validator

from rlmesh.config.actor_rollout_ref import ActorRolloutRefConfig
from rlmesh.config.base import CrossFieldProblems, Section, compat
from rlmesh.config.checks import (
    clip_grad_problems,
    cross_field_problems,
    cross_field_warnings,
    sequence_packing_problems,
)
from rlmesh.config.rlmesh_section import RlmeshSection
from rlmesh.config.sections import (
    AlgorithmConfig,
    CriticConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    RewardModelConfig,
    TrainerConfig,
)


def _default(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


class RLMeshConfig(Section):
    """Everything one rlmesh run is configured with; verl's key names, plus the `rlmesh` section."""

    data: DataConfig = Field(default_factory=DataConfig, description="datasets and batch shapes")
    actor_rollout_ref: ActorRolloutRefConfig = Field(
        default_factory=ActorRolloutRefConfig, description="policy model, actor, rollout and reference"
    )
    critic: CriticConfig = Field(default_factory=CriticConfig, description="value function")
    reward_model: RewardModelConfig = Field(
        default_factory=RewardModelConfig, description="model-based reward"
    )
    custom_reward_function: CustomRewardFunctionConfig = Field(
        default_factory=CustomRewardFunctionConfig, description="user reward function"
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="advantages and KL")
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="run length, checkpoints, logging"
    )
    rlmesh: RlmeshSection = Field(default_factory=RlmeshSection, description="services, Redis, weight sync")
    defaults: Any = compat(None)
    hydra: Any = compat(None)
    reward_manager: Any = compat({})
    global_profiler: Any = compat({})
    transfer_queue: Any = compat({})
    ray_kwargs: Any = compat({})
    ray_init: Any = compat({})
    reward: Any = compat({})
    distillation: Any = compat({})
    skip: Any = compat({})

    @model_validator(mode="after")
    def _resolve_and_check(self) -> RLMeshConfig:
        # Before the derived values hide what was set.
        early = sequence_packing_problems(self) + clip_grad_problems(self)
        self._resolve_derived()
        problems = early + cross_field_problems(self)
        if problems:
            raise CrossFieldProblems(problems)
        return self

    def config_warnings(self) -> list[str]:
        """Legal but suspicious settings; the loader emits each as a ConfigWarning."""
        return cross_field_warnings(self)

    def _resolve_derived(self) -> None:
        """verl's `${...}` defaults, in verl's direction (the source key wins when the target is null)."""
        data, arr = self.data, self.actor_rollout_ref
        model, actor, rollout, ref = arr.model, arr.actor, arr.rollout, arr.ref
        rollout.prompt_length = _default(rollout.prompt_length, data.max_prompt_length)
        rollout.response_length = _default(rollout.response_length, data.max_response_length)
        for section in (rollout, ref):
            section.log_prob_use_dynamic_bsz = _default(
                section.log_prob_use_dynamic_bsz, actor.use_dynamic_bsz
            )
            section.log_prob_max_token_len_per_gpu = _default(
                section.log_prob_max_token_len_per_gpu, actor.ppo_max_token_len_per_gpu
            )
        if data.use_sequence_packing:  # every forward; sequence_packing_problems refuses a false beside it
            model.use_remove_padding = True
            self.critic.model.use_remove_padding = True
        actor.use_remove_padding = _default(actor.use_remove_padding, model.use_remove_padding)
        for role in (actor, self.critic):
            role.grad_clip = role.optim.clip_grad = _default(
                _default(role.grad_clip, role.optim.clip_grad), 1.0
            )
        actor.clip_ratio_low = _default(actor.clip_ratio_low, actor.clip_ratio)
        actor.clip_ratio_high = _default(actor.clip_ratio_high, actor.clip_ratio)

        critic = self.critic
        critic.ppo_mini_batch_size = _default(critic.ppo_mini_batch_size, actor.ppo_mini_batch_size)
        critic.use_dynamic_bsz = _default(critic.use_dynamic_bsz, actor.use_dynamic_bsz)
        critic.ppo_epochs = _default(critic.ppo_epochs, actor.ppo_epochs)
        critic.shuffle = _default(critic.shuffle, actor.shuffle)
        critic.loss_agg_mode = _default(critic.loss_agg_mode, actor.loss_agg_mode)
        critic.forward_max_token_len_per_gpu = _default(
            critic.forward_max_token_len_per_gpu, critic.ppo_max_token_len_per_gpu
        )
        critic.forward_micro_batch_size_per_gpu = _default(
            critic.forward_micro_batch_size_per_gpu, critic.ppo_micro_batch_size_per_gpu
        )
        critic.model.tokenizer_path = _default(critic.model.tokenizer_path, model.path)
        critic.model.trust_remote_code = _default(critic.model.trust_remote_code, model.trust_remote_code)
        self.reward_model.model.input_tokenizer = _default(
            self.reward_model.model.input_tokenizer, model.path
        )

        trainer = self.trainer
        # The loader resolves this with OmegaConf; a config built in Python gets the same result here.
        # "~" expanded once here: every process reads the directory from this field, and a learner
        # that did not expand it wrote to a directory named "~" under its working directory.
        trainer.default_local_dir = os.path.expanduser(
            trainer.default_local_dir.replace("${trainer.project_name}", trainer.project_name).replace(
                "${trainer.experiment_name}", trainer.experiment_name
            )
        )

    def uses_critic(self) -> bool:
        """verl's need_critic: critic.enable when set, else only for GAE."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    def uses_reference(self) -> bool:
        """verl's need_reference_policy: a KL term to the reference is used somewhere."""
        return self.algorithm.use_kl_in_reward or self.actor_rollout_ref.actor.use_kl_loss

    def tokenizer_path(self) -> str:
        """The policy tokenizer: data.tokenizer, else model.tokenizer_path, else model.path."""
        model = self.actor_rollout_ref.model
        return self.data.tokenizer or model.tokenizer_path or model.path
