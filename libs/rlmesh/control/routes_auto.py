"""Alerts and the automatic responses to them: Prometheus's alerts, the responses' settings and
record, and Alertmanager's webhook. docs/control.md#automatic-responses"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from rlmesh.control.alerts import prometheus_alerts
from rlmesh.control.deps import API, metrics_of, plane_of

router = APIRouter(prefix=API, tags=["auto"])


class Alert(BaseModel):
    model_config = ConfigDict(extra="ignore")
    status: str = Field("firing", max_length=64)
    labels: dict[str, str] = Field(default_factory=dict)


class AlertmanagerBody(BaseModel):
    """Alertmanager's webhook payload (the fields read here; the others are ignored)."""

    model_config = ConfigDict(extra="ignore")
    alerts: list[Alert] = Field(default_factory=list, max_length=1000)


@router.get("/alerts")
async def alerts(request: Request) -> dict[str, Any]:
    """The pending and firing alerts of the Prometheus that evaluates the run's rules
    (rlmesh.control.prometheus_url); source "none" when no Prometheus is configured."""
    url = plane_of(request).cfg.rlmesh.control.prometheus_url
    if not url:
        return {"source": "none", "alerts": []}
    return {"source": url, "alerts": await prometheus_alerts(url)}


@router.get("/auto")
async def auto(request: Request) -> dict[str, Any]:
    """The automatic responses' settings and what they did (rlmesh.control.auto)."""
    plane = plane_of(request)
    return {
        "settings": plane.cfg.rlmesh.control.auto.model_dump(),
        "actions_taken": plane.auto_actions,
        "last_action_step": {rule: step for rule, (step, _) in plane.responder.last.items()},
    }


@router.post("/alerts/webhook")
async def alert_webhook(request: Request, body: AlertmanagerBody) -> dict[str, Any]:
    """Alertmanager's webhook receiver: a firing KL or grad-norm alert triggers the automatic
    response (when rlmesh.control.auto.enabled), bounded and rate-limited as for the metrics."""
    plane = plane_of(request)
    metrics = metrics_of(request)
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
