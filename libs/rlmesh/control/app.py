"""``create_app``: the control plane's FastAPI app: every route under ``/api/v1``, behind the run's
bearer token (``/health``, ``/metrics`` open), OpenAPI at ``/docs``; bad input gets a 4xx naming the
field, a peer that does not answer a 503. docs/control.md#the-api"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Body, FastAPI, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field, create_model

from rlmesh.config import RLMeshConfig
from rlmesh.config.hparams import HPARAMS
from rlmesh.control import fleet
from rlmesh.control.alerts import prometheus_alerts
from rlmesh.control.errors import ControlError
from rlmesh.control.metrics import ControlMetrics, RequestMetricsMiddleware
from rlmesh.control.plane import ControlPlane
from rlmesh.control.policy import Remedy
from rlmesh.engine.auth import BearerTokenMiddleware
from rlmesh.queue.connection import TRANSIENT_ERRORS
from rlmesh.runtime.http_guard import HttpGuard, guard_policy

log = logging.getLogger("rlmesh.control")

API = "/api/v1"
USER_HEADER = "x-rlmesh-user"
_PRINTABLE = re.compile(r"[^A-Za-z0-9_.@:+/-]")
DEAD_LETTER_ID = r"^\d{1,20}-\d{1,20}$"
# Its bodies are a few fields (a webhook's alerts the largest): far below the engines' 64 MiB.
MAX_BODY_BYTES = 1 << 20


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StopBody(Strict):
    checkpoint: bool = Field(True, description="checkpoint before exiting, so the run can resume from it")


class DrainBody(Strict):
    timeout_s: float = Field(60.0, gt=0, le=3600, description="how long in-flight tasks may take")


class RewardAddBody(Strict):
    address: str = Field(max_length=300, description="host:port of a reward service")
    force: bool = Field(False, description="add it even if its gRPC health is not SERVING")


class RewardSwapBody(Strict):
    addresses: list[Annotated[str, Field(max_length=300)]] = Field(
        min_length=1, max_length=64, description="the new list of reward services (host:port)"
    )
    force: bool = Field(False, description="swap even if one is not SERVING")


class Alert(BaseModel):
    model_config = ConfigDict(extra="ignore")
    status: str = Field("firing", max_length=64)
    labels: dict[str, str] = Field(default_factory=dict)


class AlertmanagerBody(BaseModel):
    """Alertmanager's webhook payload (the fields read here; the others are ignored)."""

    model_config = ConfigDict(extra="ignore")
    alerts: list[Alert] = Field(default_factory=list, max_length=1000)


def _hparam_field(name: str) -> Any:
    h = HPARAMS[name]
    bound = {"gt": h.low} if h.low_open else {"ge": h.low}
    return (float | None, Field(None, le=h.high, description=f"{h.what} ({h.key})", **bound))


HyperparamsBody = create_model(  # type: ignore[call-overload]
    "HyperparamsBody", __base__=Strict, **{name: _hparam_field(name) for name in HPARAMS}
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


def who(request: Request) -> str:
    """``X-Rlmesh-User`` when sent (cleaned, 64 characters at most), else the token's identity;
    with the client's address."""
    given = _PRINTABLE.sub("", request.headers.get(USER_HEADER, ""))[:64]
    client = request.client.host if request.client else "?"
    return f"{given or request.app.state.identity}@{client}"


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
    if app.state.on_ready is not None:
        app.state.on_ready()
    log.info("control plane ready", extra={"learner": plane.learner.address, "run": plane.keys.run_id})
    yield
    await plane.close()
    log.info("control plane stopped")


def plane_of(request: Request) -> ControlPlane:
    return request.app.state.plane


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
    app.state.identity = token_identity(cfg.rlmesh.auth_token)
    _routes(app)

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
    if cfg.rlmesh.auth_token:  # the page's static files are open; its API calls carry the token
        app.add_middleware(BearerTokenMiddleware, token=cfg.rlmesh.auth_token, open_paths=open_paths())
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


def _routes(app: FastAPI) -> None:
    metrics: ControlMetrics = app.state.metrics

    async def audited(request: Request, action: str) -> str:
        metrics.actions.labels(action, "api").inc()
        return who(request)

    @app.get("/health", tags=["service"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["service"], response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode())

    # ----- the run -----
    @app.get(f"{API}/run/status", tags=["run"])
    async def run_status(request: Request) -> dict[str, Any]:
        """Step, policy version, phase, ETA (mean of the last steps' times), live
        hyper-parameters and the last step's metrics."""
        return await plane_of(request).status()

    @app.get(f"{API}/run/metrics", tags=["run"])
    async def run_metrics(
        request: Request,
        keys: Annotated[
            str | None, Query(max_length=4000, description="comma-separated metric names; all when absent")
        ] = None,
        start: Annotated[int, Query(ge=0, le=10**9)] = 0,
        end: Annotated[int | None, Query(ge=0, le=10**9)] = None,
    ) -> dict[str, Any]:
        """The history of each step's metrics (as the learner logged them) in ``[start, end]``."""
        names = [k.strip() for k in keys.split(",") if k.strip()] if keys is not None else None
        if end is not None and end < start:
            raise ControlError(422, f"end: {end} is before start {start}")
        rows = await plane_of(request).history(names, start, end)
        return {"rows": rows}

    @app.get(f"{API}/run/metrics/keys", tags=["run"])
    async def run_metric_keys(request: Request) -> dict[str, list[str]]:
        rows = await plane_of(request).history(start=0)
        names = sorted({k for row in rows[-5:] for k in row["metrics"]})
        return {"keys": names}

    @app.get(f"{API}/run/validation", tags=["run"])
    async def run_validation(request: Request) -> dict[str, Any]:
        """Every validation's ``val/*`` metrics, by step (0: before training)."""
        return {"rows": await plane_of(request).history(prefix="val/")}

    @app.get(f"{API}/run/config", tags=["run"])
    async def run_config(request: Request) -> dict[str, Any]:
        """The config as the learner resolved it, secrets removed."""
        return await plane_of(request).resolved_config()

    @app.post(f"{API}/run/pause", tags=["actions"])
    async def pause(request: Request) -> dict[str, Any]:
        """The learner finishes its current step, then holds."""
        return await plane_of(request).action(await audited(request, "pause"), "pause")

    @app.post(f"{API}/run/resume", tags=["actions"])
    async def resume(request: Request) -> dict[str, Any]:
        return await plane_of(request).action(await audited(request, "resume"), "resume")

    @app.post(f"{API}/run/checkpoint", tags=["actions"])
    async def checkpoint(request: Request) -> dict[str, Any]:
        """A checkpoint at the next step boundary (at once while paused); answers with its path."""
        return await plane_of(request).action(await audited(request, "checkpoint"), "checkpoint")

    @app.post(f"{API}/run/stop", tags=["actions"])
    async def stop(request: Request, body: Annotated[StopBody | None, Body()] = None) -> dict[str, Any]:
        """Graceful stop: the learner ends its step, checkpoints (unless told not to) and exits; the
        same command resumes the run from that checkpoint."""
        keep = body.checkpoint if body is not None else True
        return await plane_of(request).action(await audited(request, "stop"), "stop", checkpoint=keep)

    # ----- hyper-parameters -----
    @app.get(f"{API}/hyperparams", tags=["hyperparams"])
    async def get_hyperparams(request: Request) -> dict[str, Any]:
        """The values in force (pending changes included) and each one's range and config key."""
        return await plane_of(request).hyperparams()

    @app.patch(f"{API}/hyperparams", tags=["hyperparams"])
    async def set_hyperparams(request: Request, body: HyperparamsBody) -> dict[str, Any]:  # type: ignore[valid-type]
        """Change live hyper-parameters; the learner applies them at its next step boundary.
        Each change is kept in the audit log with its old and new value."""
        values = {k: v for k, v in body.model_dump().items() if v is not None}  # type: ignore[attr-defined]
        return await plane_of(request).set_hyperparams(await audited(request, "set_hyperparam"), values)

    @app.get(f"{API}/audit", tags=["audit"])
    async def audit(
        request: Request,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
        action: Annotated[str | None, Query(max_length=64)] = None,
    ) -> dict[str, Any]:
        """Who changed what, when, from which value to which; newest first."""
        return {"entries": await plane_of(request).audit.entries(limit, action)}

    # ----- replicas -----
    @app.get(f"{API}/replicas", tags=["replicas"])
    async def replicas(request: Request) -> dict[str, Any]:
        """Every live replica: address, policy version, health, tokens/s, tasks in flight, last
        heartbeat."""
        plane = plane_of(request)
        return {"replicas": await fleet.list_replicas(plane.registry, plane.token)}

    @app.post(f"{API}/replicas/{{replica_id}}/drain", tags=["replicas"])
    async def drain(
        request: Request,
        replica_id: Annotated[str, Path(max_length=200)],
        body: Annotated[DrainBody | None, Body()] = None,
    ) -> dict[str, Any]:
        """The replica stops claiming, finishes its tasks (the rest go back to the queue) and
        leaves the registry; its process stays up, idle."""
        plane = plane_of(request)
        reg = await fleet.find_replica(plane.registry, replica_id)
        result = await fleet.drain_replica(reg.grpc_address, plane.token, (body or DrainBody()).timeout_s)
        await plane.audit.record(
            await audited(request, "drain"),
            "drain",
            target=replica_id,
            old=reg.state,
            new="drained",
            detail=result["message"],
        )
        return {"replica_id": replica_id, **result}

    @app.delete(f"{API}/replicas/{{replica_id}}", tags=["replicas"])
    async def remove_replica(
        request: Request, replica_id: Annotated[str, Path(max_length=200)]
    ) -> dict[str, Any]:
        """Drains the replica if it answers, then removes its registration: the learner pushes to
        it no more. A replica that is gone or cut off is removed all the same."""
        plane = plane_of(request)
        reg = await fleet.find_replica(plane.registry, replica_id)
        try:
            result = await fleet.drain_replica(reg.grpc_address, plane.token, 30.0)
            detail = result["message"]
        except ControlError as e:
            detail = f"not drained: {e.message}"
        await plane.registry.deregister(replica_id)
        await plane.audit.record(
            await audited(request, "remove_replica"),
            "remove_replica",
            target=replica_id,
            old=reg.grpc_address,
            new=None,
            detail=detail,
        )
        return {"replica_id": replica_id, "removed": True, "detail": detail}

    # ----- reward services -----
    async def current_rewards(plane: ControlPlane) -> tuple[list[str], str]:
        return await fleet.reward_addresses(
            plane.redis, plane.keys, plane.cfg.rlmesh.reward.client_addresses()
        )

    @app.get(f"{API}/rewards", tags=["rewards"])
    async def rewards(request: Request) -> dict[str, Any]:
        """The reward services replicas call now (the run's list in Redis, else the config's), each
        with its health and functions."""
        plane = plane_of(request)
        addresses, source = await current_rewards(plane)
        return {"source": source, "rewards": await fleet.list_rewards(addresses, plane.token)}

    async def swap_to(
        request: Request, action: str, new: list[str], force: bool, field: str
    ) -> dict[str, Any]:
        plane = plane_of(request)
        old, _ = await current_rewards(plane)
        if not force:
            await fleet.require_serving([a for a in new if a not in old], field)
        stored = await fleet.set_rewards(plane.redis, plane.keys, new)
        await plane.audit.record(
            await audited(request, action), action, target="rewards", old=old, new=stored
        )
        return {"addresses": stored}

    @app.post(f"{API}/rewards", tags=["rewards"])
    async def add_reward(request: Request, body: RewardAddBody) -> dict[str, Any]:
        """Adds a reward service to the list; replicas spread their calls over it within a second."""
        address = fleet.checked_addresses([body.address], "address")[0]
        old, _ = await current_rewards(plane_of(request))
        if address in old:
            raise ControlError(409, f"address: {address} is already in the list")
        return await swap_to(request, "add_reward", [*old, address], body.force, "address")

    @app.put(f"{API}/rewards", tags=["rewards"])
    async def swap_rewards(request: Request, body: RewardSwapBody) -> dict[str, Any]:
        """Replaces the whole list in one atomic write: a swap mid-run. Calls in flight finish where
        they are, a failed one is retried on the new list: no sample is lost."""
        new = fleet.checked_addresses(body.addresses, "addresses")
        return await swap_to(request, "swap_rewards", new, body.force, "addresses")

    @app.delete(f"{API}/rewards/{{address}}", tags=["rewards"])
    async def remove_reward(
        request: Request, address: Annotated[str, Path(max_length=300)]
    ) -> dict[str, Any]:
        old, _ = await current_rewards(plane_of(request))
        if address not in old:
            raise ControlError(404, f"address: {address!r} is not in the list {old}")
        if len(old) == 1:
            raise ControlError(409, f"address: {address} is the only reward service; swap instead")
        return await swap_to(request, "remove_reward", [a for a in old if a != address], True, "address")

    # ----- queues -----
    @app.get(f"{API}/queues", tags=["queues"])
    async def queues(request: Request) -> dict[str, Any]:
        """Each stream's length, entries handed out and not acked (pending), and the dead letters."""
        plane = plane_of(request)
        return await fleet.queue_depths(plane.redis, plane.keys)

    @app.get(f"{API}/dead-letters", tags=["queues"])
    async def dead_letters(
        request: Request, limit: Annotated[int, Query(ge=1, le=10_000)] = 100
    ) -> dict[str, Any]:
        plane = plane_of(request)
        return {"dead_letters": await fleet.dead_letters(plane.redis, plane.keys, limit)}

    @app.post(f"{API}/dead-letters/{{dead_letter_id}}/replay", tags=["queues"])
    async def replay(
        request: Request, dead_letter_id: Annotated[str, Path(pattern=DEAD_LETTER_ID, max_length=41)]
    ) -> dict[str, Any]:
        """Puts a dead letter back on its queue as a new entry and removes it from the dead letters."""
        plane = plane_of(request)
        result = await fleet.replay_dead_letter(plane.redis, plane.keys, dead_letter_id)
        await plane.audit.record(
            await audited(request, "replay_dead_letter"),
            "replay_dead_letter",
            target=dead_letter_id,
            new=result["new_entry_id"],
            detail=result["stream"],
        )
        return result

    # ----- alerts -----
    @app.get(f"{API}/alerts", tags=["auto"])
    async def alerts(request: Request) -> dict[str, Any]:
        """The pending and firing alerts of the Prometheus that evaluates the run's rules
        (rlmesh.control.prometheus_url); source "none" when no Prometheus is configured."""
        url = plane_of(request).cfg.rlmesh.control.prometheus_url
        if not url:
            return {"source": "none", "alerts": []}
        return {"source": url, "alerts": await prometheus_alerts(url)}

    # ----- automatic responses -----
    @app.get(f"{API}/auto", tags=["auto"])
    async def auto(request: Request) -> dict[str, Any]:
        """The automatic responses' settings and what they did (rlmesh.control.auto)."""
        plane = plane_of(request)
        return {
            "settings": plane.cfg.rlmesh.control.auto.model_dump(),
            "actions_taken": plane.auto_actions,
            "last_action_step": {rule: step for rule, (step, _) in plane.responder.last.items()},
        }

    @app.post(f"{API}/alerts/webhook", tags=["auto"])
    async def alert_webhook(request: Request, body: AlertmanagerBody) -> dict[str, Any]:
        """Alertmanager's webhook receiver: a firing KL or grad-norm alert triggers the automatic
        response (when rlmesh.control.auto.enabled), bounded and rate-limited as for the metrics."""
        plane = plane_of(request)
        firing = sorted({a.labels.get("alertname", "") for a in body.alerts if a.status == "firing"} - {""})
        if not plane.cfg.rlmesh.control.auto.enabled:
            return {"enabled": False, "firing": firing, "actions": []}
        actions = []
        for name in firing:
            remedy = await plane.respond_to_alert(name)
            if remedy is not None:
                metrics.auto_actions.labels(remedy.rule, remedy.hparam).inc()
                actions.append({"alert": name, "hparam": remedy.hparam, "old": remedy.old, "new": remedy.new})
        return {"enabled": True, "firing": firing, "actions": actions}
