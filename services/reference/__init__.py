"""The reference service."""
