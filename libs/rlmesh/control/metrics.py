"""The control plane's Prometheus metrics (its requests, their latency, the actions it took) in a
registry of its own, and the plain-ASGI middleware that counts requests by route template."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from rlmesh.engine.auth import ASGIApp, Message, Receive, Scope, Send


class ControlMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry or CollectorRegistry()
        self.requests = Counter(
            "rlmesh_control_requests",
            "REST requests answered, by route template and status",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "rlmesh_control_request_latency_seconds",
            "REST request latency",
            ["route"],
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60),
        )
        self.actions = Counter(
            "rlmesh_control_actions",
            "Changes the control plane made (pause, resume, checkpoint, stop, set_hyperparam, drain, ...)",
            ["action", "source"],
            registry=registry,
        )
        self.auto_actions = Counter(
            "rlmesh_control_auto_actions",
            "Automatic responses applied, by rule (rlmesh.control.auto)",
            ["rule", "hparam"],
            registry=registry,
        )


def route_label(scope: Scope) -> str:
    """The matched route's template (``/api/v1/replicas/{replica_id}/drain``), never the raw path:
    labels stay few whatever callers send."""
    route: Any = scope.get("route")
    endpoint: Any = scope.get("endpoint")
    return getattr(route, "path", None) or getattr(endpoint, "__name__", None) or "unmatched"


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: ControlMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            route = route_label(scope)
            self.metrics.requests.labels(scope["method"], route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
