"""Prometheus metrics for every service: per-RPC counts, errors, latency and in-flight calls.

docs/design.md#the-processes"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RpcMetrics:
    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.service = service
        self.requests = Counter(
            "rlmesh_rpc_requests",
            "RPCs finished, by method and status code",
            ["service", "method", "code"],
            registry=registry,
        )
        self.errors = Counter(
            "rlmesh_rpc_errors",
            "RPCs that ended with a status other than OK",
            ["service", "method", "code"],
            registry=registry,
        )
        self.latency = Histogram(
            "rlmesh_rpc_latency_seconds",
            "RPC handling time",
            ["service", "method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "rlmesh_rpc_in_flight",
            "RPCs being handled now",
            ["service", "method"],
            registry=registry,
        )

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.requests.labels(self.service, method, code.name).inc()
        if code != grpc.StatusCode.OK:
            self.errors.labels(self.service, method, code.name).inc()
        self.latency.labels(self.service, method).observe(seconds)


def _status_of(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if exc is None:
        return grpc.StatusCode.OK
    # An exception that is not an abort() surfaces to the caller as UNKNOWN (or CANCELLED).
    return grpc.StatusCode.CANCELLED if isinstance(exc, asyncio.CancelledError) else grpc.StatusCode.UNKNOWN


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times every RPC and counts it by status code; covers all four RPC kinds."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        metrics = self.metrics

        def wrap_unary_response(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                gauge = metrics.in_flight.labels(metrics.service, method)
                gauge.inc()
                exc: BaseException | None = None
                try:
                    return await behavior(request_or_iterator, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    gauge.dec()
                    metrics.observe(method, _status_of(context, exc), time.perf_counter() - start)

            return wrapped

        def wrap_stream_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                gauge = metrics.in_flight.labels(metrics.service, method)
                gauge.inc()
                exc: BaseException | None = None
                try:
                    async for item in behavior(request_or_iterator, context):
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    gauge.dec()
                    metrics.observe(method, _status_of(context, exc), time.perf_counter() - start)

            return wrapped

        return replace_behavior(handler, wrap_unary_response, wrap_stream_response)


def replace_behavior(
    handler: grpc.RpcMethodHandler,
    wrap_unary_response: Callable[[Any], Any],
    wrap_stream_response: Callable[[Any], Any],
) -> grpc.RpcMethodHandler:
    """Returns ``handler`` with its behavior wrapped, keeping its kind and (de)serializers."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary_response(handler.unary_unary), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap_unary_response(handler.stream_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_stream_response(handler.unary_stream), **kw)
    return grpc.stream_stream_rpc_method_handler(wrap_stream_response(handler.stream_stream), **kw)


class MetricsHttpServer:
    """Serves ``/metrics`` of one registry over HTTP on its own thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._httpd.server_port
        self.host = host

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if isinstance(self._thread, threading.Thread):
            self._thread.join(timeout=5)
