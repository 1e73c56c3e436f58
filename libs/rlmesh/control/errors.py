"""``ControlError``: what the control plane answers when it cannot do what was asked, as an HTTP
status and a message that names the field or the peer at fault; and the mapping of gRPC errors."""

from __future__ import annotations

import grpc

# A peer's gRPC refusal, as the HTTP status the control plane answers with.
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 422,
    grpc.StatusCode.OUT_OF_RANGE: 422,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 503,
}


class ControlError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def from_rpc_error(peer: str, error: grpc.aio.AioRpcError) -> ControlError:
    """A failed call to ``peer`` as a ``ControlError``: its refusal passed on (4xx), or the peer
    unreachable (503/504), or something the operator must fix between the two (502)."""
    code = error.code()
    status = GRPC_TO_HTTP.get(code, 502)
    return ControlError(status, f"{peer}: {code.name}: {error.details() or 'no details'}")
