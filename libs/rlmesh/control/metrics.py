"""The control plane's Prometheus metrics (its requests, their latency, the actions it took) in a
registry of its own, and the plain-ASGI middleware that counts requests by route template and
method, each from a fixed set: whatever callers send, the series stay few."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry

from rlmesh.queue.signing import expose_untrusted
from rlmesh.runtime.http_guard import ASGIApp, Message, Receive, Scope, Send
from rlmesh.runtime.prometheus import MetricSet

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
OTHER = "other"


class ControlMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry or CollectorRegistry()
        expose_untrusted(registry)  # what the plane skipped of what it read from Redis
        series = MetricSet(registry)
        self.requests = series.counter(
            "rlmesh_control_requests",
            "REST requests answered, by route template and status",
            ["method", "route", "status"],
        )
        self.latency = series.histogram(
            "rlmesh_control_request_latency_seconds",
            "REST request latency",
            ["route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60),
        )
        self.actions = series.counter(
            "rlmesh_control_actions",
            "Changes the control plane made (pause, resume, checkpoint, stop, set_hyperparam, drain, ...)",
            ["action", "source"],
        )
        self.auto_actions = series.counter(
            "rlmesh_control_auto_actions",
            "Automatic responses applied, by rule (rlmesh.control.auto)",
            ["rule", "hparam"],
        )
        # The autoscaler's (rlmesh.control.autoscale): KEDA or an HPA scales compose or Kubernetes
        # replicas to the desired count (docs/control.md#autoscaling).
        self.desired_replicas = series.gauge(
            "rlmesh_autoscale_desired_replicas", "Rollout replicas the autoscaler asks for"
        )
        self.live_replicas = series.gauge(
            "rlmesh_autoscale_live_replicas",
            "Rollout replicas registered and not draining, as the autoscaler counted them",
        )
        self.scale_changes = series.counter(
            "rlmesh_autoscale_changes", "Changes of the desired replica count, by direction", ["direction"]
        )
        self.task_rates = series.gauge(
            "rlmesh_autoscale_tasks_per_second",
            "Prompt tasks per second as the autoscaler averages them: arriving, finished, and what one "
            "replica finishes with every slot busy",
            ["rate"],
        )


def route_label(scope: Scope) -> str:
    """The template of the app's route that served the request (``/api/v1/replicas/{replica_id}/drain``;
    ``/dashboard`` for the page's files), never the raw path; ``other`` when none did (no such
    path, or refused before routing)."""
    route: Any = scope.get("route")
    if route is not None:
        return str(route.path)
    endpoint, app = scope.get("endpoint"), scope.get("app")
    # A Starlette route or mount puts only its endpoint in the scope: find the route it belongs to.
    for candidate in getattr(app, "routes", ()) if endpoint is not None else ():
        if endpoint is getattr(candidate, "endpoint", None) or endpoint is getattr(candidate, "app", None):
            return str(candidate.path)
    return OTHER


def method_label(scope: Scope) -> str:
    method = scope["method"]
    return method if method in METHODS else OTHER


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
            self.metrics.requests.labels(method_label(scope), route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
