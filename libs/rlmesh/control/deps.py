"""What the control plane's routers (``routes_*.py``) share: the ``/api/v1`` prefix, strict bodies, the
plane and the metrics (from the app's state, so that an app built without its lifespan still validates)
and who asked for an action."""

from __future__ import annotations

import re

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from rlmesh.control.metrics import ControlMetrics
from rlmesh.control.plane import ControlPlane

API = "/api/v1"
USER_HEADER = "x-rlmesh-user"
_PRINTABLE = re.compile(r"[^A-Za-z0-9_.@:+/-]")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def plane_of(request: Request) -> ControlPlane:
    """The plane the app's lifespan built."""
    return request.app.state.plane


def metrics_of(request: Request) -> ControlMetrics:
    """The app's metrics (``create_app``'s)."""
    return request.app.state.metrics


def who(request: Request) -> str:
    """``X-Rlmesh-User`` when sent (cleaned, 64 characters at most), else the token's identity;
    with the client's address."""
    given = _PRINTABLE.sub("", request.headers.get(USER_HEADER, ""))[:64]
    client = request.client.host if request.client else "?"
    return f"{given or request.app.state.identity}@{client}"


def audited(request: Request, action: str) -> str:
    """Counts ``action`` as asked through the API; answers who asked, for the audit log."""
    metrics_of(request).actions.labels(action, "api").inc()
    return who(request)
