"""The learner service."""
