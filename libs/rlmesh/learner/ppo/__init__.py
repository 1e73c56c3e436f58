"""PPO on DeepSpeed: the trainer (actor + critic), their update loops, the batch layout, model loading."""
