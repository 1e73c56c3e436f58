"""The control service."""
