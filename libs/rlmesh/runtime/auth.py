"""Bearer-token auth for gRPC: a server interceptor that refuses calls without the token, and
client interceptors that attach it. Health and reflection stay open so probes need no secret."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from rlmesh.runtime.metrics import replace_behavior

OPEN_METHOD_PREFIXES: tuple[str, ...] = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>`` with UNAUTHENTICATED."""

    def __init__(self, token: str, open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES) -> None:
        if not token:
            raise ValueError("BearerTokenInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()
        self._open_prefixes = tuple(open_prefixes)

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
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open_prefixes):
            return handler
        verdict = self._authorized(handler_call_details)
        if verdict is True:
            return handler
        reason = f"{handler_call_details.method}: {verdict}"

        async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        async def refuse_stream(_request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
            yield  # pragma: no cover - makes this an async generator like the handler it replaces

        # The refusal keeps the request as raw bytes: a caller without the token never gets its
        # message parsed (the server's size limit already bounds what is read).
        refusal = replace_behavior(handler, lambda _b: refuse, lambda _b: refuse_stream)
        return refusal._replace(request_deserializer=None)  # a namedtuple


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


def client_auth_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the bearer token to unary and server-streaming calls of a channel."""
    return [_BearerUnaryUnary(token), _BearerUnaryStream(token)] if token else []
