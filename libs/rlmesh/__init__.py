"""rlmesh: PPO post-training for language models as decoupled services."""

__version__ = "0.1.0"
