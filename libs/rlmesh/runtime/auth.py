"""Bearer-token auth for gRPC: a server interceptor that refuses every call but ``Health/Check``
without the token, ending it before its request is read, and client interceptors that attach it.
docs/security.md#tokens"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import grpc

# Exact paths, not prefixes: a streaming method (Health/Watch) next to an open one stays closed.
OPEN_METHODS: frozenset[str] = frozenset({"/grpc.health.v1.Health/Check"})


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _refusal(reason: str) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the request.

    gRPC reads the request of a unary-request method before its behavior runs, so a caller that
    sends headers and no message would hold a concurrency slot; a stream-request behavior runs at
    once. The kind is not on the wire, so one stream-unary refusal serves a method of any kind, and
    a request never read is never parsed."""

    async def refuse(_requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    return grpc.stream_unary_rpc_method_handler(refuse)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>`` with UNAUTHENTICATED, to a
    method that does not exist too (a caller without the token learns no method names)."""

    def __init__(self, token: str, open_methods: Collection[str] = OPEN_METHODS) -> None:
        if not token:
            raise ValueError("BearerTokenInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()
        self._open_methods = frozenset(open_methods)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool | str:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return True if hmac.compare_digest(given, self._expected) else "invalid bearer token"
        return "missing 'authorization: Bearer <token>' metadata"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        verdict = True if method in self._open_methods else self._authorized(handler_call_details)
        if verdict is True:
            return await continuation(handler_call_details)
        return _refusal(f"{method}: {verdict}")


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add("authorization", f"Bearer {token}")
    return grpc.aio.ClientCallDetails(
        method=details.method,
        timeout=details.timeout,
        metadata=metadata,
        credentials=details.credentials,
        wait_for_ready=details.wait_for_ready,
    )


class _BearerUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(client_call_details, self.token), request)


class _BearerUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(client_call_details, self.token), request)


class _BearerStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(client_call_details, self.token), request_iterator)


class _BearerStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(client_call_details, self.token), request_iterator)


def client_auth_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the bearer token to every call of a channel, of all four kinds
    (reflection streams both ways)."""
    if not token:
        return []
    return [
        _BearerUnaryUnary(token),
        _BearerUnaryStream(token),
        _BearerStreamUnary(token),
        _BearerStreamStream(token),
    ]
