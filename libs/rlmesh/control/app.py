"""``create_app``: the control plane's FastAPI app: the routers of ``routes_*.py``, behind the run's bearer
token (``/health``, ``/metrics`` open), OpenAPI at ``/docs``; bad input gets a 4xx naming the field,
a peer that does not answer a 503. docs/control.md#the-api"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rlmesh.config import RLMeshConfig
from rlmesh.control import (
    routes_audit,
    routes_auto,
    routes_hyperparams,
    routes_queues,
    routes_replicas,
    routes_rewards,
    routes_run,
    routes_service,
)
from rlmesh.control.auto_response import Remedy
from rlmesh.control.autoscale import FleetReading, ScaleDecision
from rlmesh.control.errors import ControlError
from rlmesh.control.metrics import ControlMetrics, RequestMetricsMiddleware
from rlmesh.control.plane import ControlPlane
from rlmesh.queue.connection import TRANSIENT_ERRORS
from rlmesh.runtime.http_auth import BearerTokenMiddleware
from rlmesh.runtime.http_guard import HttpGuard, guard_policy

log = logging.getLogger("rlmesh.control")

# Its bodies are a few fields (a webhook's alerts the largest): far below the engines' 64 MiB.
MAX_BODY_BYTES = 1 << 20
# One router per resource, in the OpenAPI schema's order. Their routes themselves, not include_router
# (as the engine's app): FastAPI 0.165 matches an included router through a nested lookup.
ROUTERS = (
    routes_service.router,
    routes_run.router,
    routes_hyperparams.router,
    routes_audit.router,
    routes_replicas.router,
    routes_rewards.router,
    routes_queues.router,
    routes_auto.router,
)


def token_identity(token: str | None) -> str:
    """Who a request is when it says nothing: the token's short fingerprint (never the token)."""
    return f"token:{hashlib.sha256(token.encode()).hexdigest()[:8]}" if token else "anonymous"


def json_safe(value: Any) -> Any:
    """``value`` with each NaN or infinity as its name: a 422 quoting the input it refused must
    still be JSON (Python's json reads ``NaN``, but the answer may not hold one)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    plane = ControlPlane(app.state.cfg, learner_address=app.state.learner_address)
    app.state.plane = plane
    metrics: ControlMetrics = app.state.metrics

    def counted(remedy: Remedy) -> None:
        metrics.auto_actions.labels(remedy.rule, remedy.hparam).inc()
        metrics.actions.labels("set_hyperparam", "auto").inc()

    if app.state.cfg.rlmesh.control.auto.enabled:
        plane.start_auto(counted)

    def scaled(reading: FleetReading, decision: ScaleDecision) -> None:
        metrics.desired_replicas.set(decision.desired)
        metrics.live_replicas.set(len(reading.live))
        metrics.task_rates.labels("arriving").set(decision.arrival_per_s)
        metrics.task_rates.labels("finished").set(decision.done_per_s)
        metrics.task_rates.labels("per_replica").set(decision.replica_tasks_per_s or 0.0)
        if decision.changed:
            metrics.scale_changes.labels("up" if decision.desired > decision.before else "down").inc()
            metrics.actions.labels("scale_replicas", "auto").inc()

    if app.state.cfg.rlmesh.control.autoscale.enabled:
        plane.start_autoscale(scaled)
    if app.state.on_ready is not None:
        app.state.on_ready()
    log.info("control plane ready", extra={"learner": plane.learner.address, "run": plane.keys.run_id})
    yield
    await plane.close()
    log.info("control plane stopped")


def create_app(
    cfg: RLMeshConfig,
    *,
    metrics: ControlMetrics | None = None,
    learner_address: str | None = None,
    on_ready: Callable[[], None] | None = None,
    own_hosts: Sequence[str] = (),
) -> FastAPI:
    """The app for the run ``cfg`` names; the learner at ``learner_address`` (default the config's
    ``rlmesh.learner`` address). ``on_ready`` runs once the plane is up (the ready file).

    In front of every route (docs/security.md#http): a Host other than loopback, an IP address,
    the plane's own (``rlmesh.control.host`` and ``advertise_address``, ``own_hosts``) or
    ``rlmesh.security.allowed_hosts`` gets a 421; a change whose Origin is not the plane's own or
    allowed a 403, whose body is not JSON a 415; a body past ``MAX_BODY_BYTES`` a 413."""
    app = FastAPI(
        title="rlmesh control plane",
        version="1",
        description="Drive a running rlmesh PPO job: status, metrics, actions, hyper-parameters, "
        "replicas, reward services, queues. docs/control.md",
        lifespan=lifespan,
    )
    app.state.cfg = cfg
    app.state.metrics = metrics = metrics or ControlMetrics()
    app.state.learner_address = learner_address
    app.state.on_ready = on_ready
    app.state.identity = token_identity(cfg.rlmesh.token())
    app.router.routes.extend(route for router in ROUTERS for route in router.routes)

    @app.exception_handler(ControlError)
    async def control_error(request: Request, e: ControlError) -> JSONResponse:
        return JSONResponse({"detail": e.message}, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer, but one that a NaN in the body cannot turn into a 500.
        return JSONResponse({"detail": json_safe(jsonable_encoder(e.errors()))}, status_code=422)

    for error in TRANSIENT_ERRORS:

        @app.exception_handler(error)
        async def redis_down(request: Request, e: Exception) -> JSONResponse:
            return JSONResponse({"detail": f"redis: unavailable: {e}"}, status_code=503)

    from rlmesh.control.dashboard import mount_dashboard, open_paths  # the page: docs/control.md#dashboard

    mount_dashboard(app)
    token = cfg.rlmesh.token()
    if token:  # the page's static files are open; its API calls carry the token
        app.add_middleware(BearerTokenMiddleware, token=token, open_paths=open_paths())
    security = cfg.rlmesh.security
    section = cfg.rlmesh.control
    policy = guard_policy(
        own_hosts=[section.host, section.advertise_address or "", *own_hosts],
        allowed_hosts=security.allowed_hosts,
        allowed_origins=security.allowed_origins,
        max_body_bytes=MAX_BODY_BYTES,
        json_bodies_only=True,  # an HTML form's text/plain or urlencoded POST is a cross-site one
    )
    app.add_middleware(HttpGuard, policy=policy)  # before the token: a refused request is not asked for one
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)  # outermost: refusals count too
    return app
