"""The reward service."""
