"""Moved to tests/support/ (polling, processes); this re-export goes once the engine tests import
from there."""

from tests.support.polling import wait_until
from tests.support.processes import child_env

__all__ = ["child_env", "wait_until"]
