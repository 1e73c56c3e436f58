"""Prometheus metrics for every service: per-RPC counts, errors, latency and in-flight calls, the
``method`` label from the methods the server registered (no caller-made series).
docs/design.md#the-processes"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from rlmesh.runtime.prometheus import MetricSet

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The one label every method the server does not serve shares (e.g. a refused caller probing names).
UNKNOWN_METHOD = "unknown"


class RpcMetrics:
    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.service = service
        series = MetricSet(registry)
        self.requests = series.counter(
            "rlmesh_rpc_requests", "RPCs finished, by method and status code", ["service", "method", "code"]
        )
        self.errors = series.counter(
            "rlmesh_rpc_errors", "RPCs that ended with a status other than OK", ["service", "method", "code"]
        )
        self.latency = series.histogram(
            "rlmesh_rpc_latency_seconds", "RPC handling time", ["service", "method"], buckets=LATENCY_BUCKETS
        )
        self.in_flight = series.gauge("rlmesh_rpc_in_flight", "RPCs being handled now", ["service", "method"])

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
    """Times every RPC and counts it by status code; covers all four RPC kinds.

    ``methods`` is the fixed set of labels (full method paths, ``/package.Service/Method``); it may
    be filled after the interceptor is made, as servicers are added. A call to any other method that
    an inner interceptor answers (a refusal) is counted as ``UNKNOWN_METHOD``; one that nothing
    answers gets UNIMPLEMENTED from gRPC and is not counted."""

    def __init__(self, metrics: RpcMetrics, methods: Collection[str]) -> None:
        self.metrics = metrics
        self.methods = methods

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        label = method if method in self.methods else UNKNOWN_METHOD
        metrics = self.metrics

        def wrap_coroutine(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                gauge = metrics.in_flight.labels(metrics.service, label)
                gauge.inc()
                exc: BaseException | None = None
                try:
                    return await behavior(request_or_iterator, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    gauge.dec()
                    metrics.observe(label, _status_of(context, exc), time.perf_counter() - start)

            return wrapped

        def wrap_generator(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                gauge = metrics.in_flight.labels(metrics.service, label)
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
                    metrics.observe(label, _status_of(context, exc), time.perf_counter() - start)

            return wrapped

        return replace_behavior(handler, wrap_coroutine, wrap_generator)


def replace_behavior(
    handler: grpc.RpcMethodHandler,
    wrap_coroutine: Callable[[Any], Any],
    wrap_generator: Callable[[Any], Any],
) -> grpc.RpcMethodHandler:
    """Returns ``handler`` with its behavior wrapped, keeping its kind and (de)serializers.

    A streaming response comes either from an async generator (``yield``) or from a coroutine that
    writes with ``context.write`` (grpc_health's ``Watch``); gRPC tells them apart by the function's
    kind, so each is wrapped by a function of the same kind: ``wrap_generator`` for async
    generators, ``wrap_coroutine`` for everything else (every unary response included)."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }

    def wrap(behavior: Any) -> Any:
        return wrap_generator(behavior) if inspect.isasyncgenfunction(behavior) else wrap_coroutine(behavior)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **kw)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **kw)


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
