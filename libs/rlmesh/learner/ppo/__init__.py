"""PPO on DeepSpeed: the actor and the critic, their update loops, the batch layout, model loading."""
