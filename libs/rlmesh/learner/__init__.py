"""The learner's training core: PPO under DeepSpeed ZeRO, as a library the learner service calls.

    batch = build_batch(trajectories, pad_token_id=tokenizer.pad_token_id)
    trainer = PPOTrainer(cfg, total_training_steps=cfg.trainer.total_training_steps)
    metrics = trainer.train_step(batch, kl_ctrl)
    for bucket in trainer.named_weights_for_push(bucket_bytes): ...
    trainer.save_checkpoint(path, extra_state); trainer.load_checkpoint(latest_checkpoint(root))

See docs in each module: batch (trajectories -> tensors), trainer (the PPO step), weights (push),
checkpoint (atomic checkpoints), export (``rlmesh export``), sft (``rlmesh sft``).
"""

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
