"""Moved to tests/support/protostrategies.py; this re-export goes once the engine tests import from
there."""

from tests.support.protostrategies import FUZZ

__all__ = ["FUZZ"]
