"""The error a service's core raises for a request it refuses as malformed; its servicer answers
gRPC INVALID_ARGUMENT. Imports nothing, so a pre-flight check can raise it without gRPC."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The batch itself is malformed (gRPC INVALID_ARGUMENT); the message says what is wrong."""
