"""The learner's training core: PPO under DeepSpeed ZeRO, as a library the learner service calls.

docs/internals.md#rlmeshlearner"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlmesh.learner.checkpoints.store import CheckpointError, latest_checkpoint
from rlmesh.learner.ppo.batch import BatchError, PPOBatch, build_batch, validate_trajectory

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    # On first use: the trainer imports DeepSpeed (seconds), which a process that only reads or
    # exports a checkpoint (`rlmesh train` once its learner is done) never needs.
    if name == "PPOTrainer":
        from rlmesh.learner.trainer import PPOTrainer

        return PPOTrainer
    if name == "run_sft":
        from rlmesh.learner.sft import run_sft

        return run_sft
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
