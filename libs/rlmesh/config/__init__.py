"""rlmesh's typed config tree: verl's keys and defaults, plus the `rlmesh` section.

docs/internals.md#rlmeshconfig"""

from rlmesh.config.actor_rollout_ref import (
    ActorConfig,
    ActorRolloutRefConfig,
    ModelConfig,
    RefConfig,
    RolloutConfig,
    SglangConfig,
    ValKwargs,
)
from rlmesh.config.base import COMPAT_DESCRIPTION, ConfigWarning
from rlmesh.config.errors import ConfigError
from rlmesh.config.key_catalog import ConfigKey, config_keys, keys_markdown_table
from rlmesh.config.loader import (
    ENV_AUTH_TOKEN,
    config_from_dict,
    dump_yaml,
    given_keys,
    ignored_keys,
    load_config,
)
from rlmesh.config.optim import DeepSpeedConfig, EngineSettings, FsdpConfig, OptimConfig
from rlmesh.config.rlmesh_section import (
    SERVICE_PORTS,
    QueueConfig,
    RlmeshSection,
    RuntimeConfig,
    ServiceConfig,
    WeightSyncConfig,
)
from rlmesh.config.schema import RLMeshConfig
from rlmesh.config.sections import (
    AlgorithmConfig,
    CriticConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    KLCtrlConfig,
    RewardModelConfig,
    RolloutCorrectionConfig,
    TrainerConfig,
)

__all__ = [
    "COMPAT_DESCRIPTION",
    "ENV_AUTH_TOKEN",
    "SERVICE_PORTS",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "ConfigError",
    "ConfigKey",
    "ConfigWarning",
    "CriticConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "DeepSpeedConfig",
    "EngineSettings",
    "FsdpConfig",
    "KLCtrlConfig",
    "ModelConfig",
    "OptimConfig",
    "QueueConfig",
    "RLMeshConfig",
    "RefConfig",
    "RewardModelConfig",
    "RlmeshSection",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RuntimeConfig",
    "ServiceConfig",
    "SglangConfig",
    "TrainerConfig",
    "ValKwargs",
    "WeightSyncConfig",
    "config_from_dict",
    "config_keys",
    "dump_yaml",
    "given_keys",
    "ignored_keys",
    "keys_markdown_table",
    "load_config",
]
