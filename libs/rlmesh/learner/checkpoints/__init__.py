"""Checkpoints: atomic save and load of a learner step, and HF directories of the actor."""
