"""The learner's run loop around the trainer: prompt feeding, batch collection, weight pushes,
checkpoints, validation and metrics. The model math lives in ``rlmesh.learner``."""
