"""Moved to tests/support/netproxy.py; this re-export goes once the engine tests import from there."""

from tests.support.netproxy import PartitionableProxy

__all__ = ["PartitionableProxy"]
