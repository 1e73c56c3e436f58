"""``create_app``: the engine's FastAPI app, its routers, and its start and stop (lifespan)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI

from rlmesh.engine import routes_control, routes_generate, routes_weights
from rlmesh.engine.protocol import MAX_BODY_BYTES, error_body
from rlmesh.engine.state import EngineState, load_state
from rlmesh.runtime.http_auth import BearerTokenMiddleware
from rlmesh.runtime.http_guard import HttpGuard, guard_policy
from rlmesh.runtime.ready_file import write_ready_file

log = logging.getLogger("rlmesh.engine")

# The routers' routes themselves, not include_router: FastAPI 0.165 matches an included router
# through a nested lookup, ~70 us more a request on a small CPU.
ROUTES = [route for m in (routes_generate, routes_control, routes_weights) for route in m.router.routes]


@asynccontextmanager
async def lifespan(
    app: FastAPI, *, ready_file: str | None, port_holder: dict[str, int] | None
) -> AsyncIterator[None]:
    state: EngineState = app.state.engine_state
    state.loop = asyncio.get_running_loop()
    state.engine.start()
    if ready_file:
        port = (port_holder or {}).get("port")
        write_ready_file(ready_file, {"pid": os.getpid(), "port": port, "model_path": state.model_path})
    log.info("engine ready", extra={"model_path": state.model_path, "max_batch_size": state.max_batch_size})
    yield
    state.engine.stop()
    log.info("engine stopped")


def create_app(
    model_path: str,
    *,
    max_batch_size: int = 64,
    weight_version: str = "default",
    skip_tokenizer_init: bool = False,
    weight_sync_timeout_s: float = 600.0,
    ready_file: str | None = None,
    port_holder: dict[str, int] | None = None,
    auth_token: str | None = None,
    override_config: dict[str, Any] | None = None,
    own_hosts: Sequence[str] = ("127.0.0.1",),
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    """Loads the model at ``model_path``; the engine starts with the app (and writes ``ready_file``,
    with the port in ``port_holder``, once it has). With ``auth_token`` every route but the health
    probes and /metrics answers 401 to a request without ``Authorization: Bearer <auth_token>``.

    In front of every route (docs/security.md#http): a Host other than loopback, an IP address,
    ``own_hosts`` (the bind host) or ``allowed_hosts`` gets a 421; a state change whose Origin is
    not the engine's own or in ``allowed_origins`` a 403, one declaring a body other than JSON a
    415; a body past ``MAX_BODY_BYTES`` a 413 as it streams in."""
    state = load_state(
        model_path,
        max_batch_size=max_batch_size,
        weight_version=weight_version,
        skip_tokenizer_init=skip_tokenizer_init,
        weight_sync_timeout_s=weight_sync_timeout_s,
        override_config=override_config,
    )
    app = FastAPI(
        title="rlmesh embedded engine",
        lifespan=partial(lifespan, ready_file=ready_file, port_holder=port_holder),
        routes=ROUTES,
    )
    app.state.engine_state = state
    if auth_token:
        app.add_middleware(BearerTokenMiddleware, token=auth_token)
    policy = guard_policy(
        own_hosts=own_hosts,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
        max_body_bytes=MAX_BODY_BYTES,
        hosts_setting="--allowed-host (rlmesh.security.allowed_hosts)",
        origins_setting="--allowed-origin (rlmesh.security.allowed_origins)",
    )
    # Outermost: a refused request reaches neither the token check nor a route.
    app.add_middleware(HttpGuard, policy=policy, error_body=error_body)
    return app
