"""The learner's training core: PPO under DeepSpeed ZeRO, as a library the learner service calls.

docs/internals.md#rlmeshlearner"""

from rlmesh.learner.batch import BatchError, PPOBatch, build_batch, validate_trajectory
from rlmesh.learner.checkpoint import CheckpointError, latest_checkpoint
from rlmesh.learner.sft import run_sft
from rlmesh.learner.trainer import PPOTrainer

__all__ = [
    "BatchError",
    "CheckpointError",
    "PPOBatch",
    "PPOTrainer",
    "build_batch",
    "latest_checkpoint",
    "run_sft",
    "validate_trajectory",
]
