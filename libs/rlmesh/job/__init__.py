"""Whole jobs on one machine: ``rlmesh train`` (a user's config, every service a process) and
``rlmesh demo`` (a preset over it). docs/train.md describes both."""
