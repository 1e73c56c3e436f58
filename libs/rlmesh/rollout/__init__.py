"""The rollout replica's library: the sampler loop, engine launching, retries and breakers."""
