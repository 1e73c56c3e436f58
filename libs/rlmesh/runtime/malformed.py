"""Refuses a request whose bytes are not the message its method takes with INVALID_ARGUMENT
naming that message, where gRPC alone would answer UNKNOWN with a parser's traceback."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from rlmesh.runtime.metrics import replace_behavior


class _Malformed:
    def __init__(self, error: Exception) -> None:
        self.error = error


class RefuseMalformedInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        parse = handler.request_deserializer if handler is not None else None
        if parse is None or handler.request_streaming:
            return handler
        method = handler_call_details.method

        def safe_parse(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as e:  # DecodeError, or a message nested too deep
                return _Malformed(e)

        descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
        message = descriptor.full_name if descriptor is not None else "request message"

        def reason(request: _Malformed) -> str:
            return f"{method}: the request is not a valid {message} ({request.error})"

        def wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason(request))
                return await behavior(request, context)

            return checked

        def wrap_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason(request))
                async for item in behavior(request, context):
                    yield item

            return checked

        handler = replace_behavior(handler, wrap_unary, wrap_stream)
        return handler._replace(request_deserializer=safe_parse)
