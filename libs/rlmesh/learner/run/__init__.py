"""The run loop: one PPO step at a time (collect, train, push, checkpoint) and what it reports."""
