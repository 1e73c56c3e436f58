"""The alerts Prometheus holds for the run (``rlmesh.control.prometheus_url``: the server that
evaluates deploy/alerts.yml), for ``GET /api/v1/alerts`` and the dashboard. docs/control.md#the-api"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

from rlmesh.control.errors import ControlError

# Prometheus' own address on the run's network: never through an HTTP proxy of the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _fetch(url: str, timeout_s: float) -> dict[str, Any]:
    with _DIRECT.open(f"{url.rstrip('/')}/api/v1/alerts", timeout=timeout_s) as resp:
        return json.loads(resp.read())


async def prometheus_alerts(url: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """Every pending or firing alert Prometheus evaluates, firing first: name, state, severity,
    summary, since when, its value and labels. A Prometheus that does not answer is a 503."""
    try:
        body = await asyncio.to_thread(_fetch, url, timeout_s)
        alerts = body["data"]["alerts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ControlError(503, f"prometheus at {url} did not answer its alerts API: {e}") from None
    out = [
        {
            "name": a.get("labels", {}).get("alertname", ""),
            "state": a.get("state", ""),
            "severity": a.get("labels", {}).get("severity", ""),
            "summary": a.get("annotations", {}).get("summary", ""),
            "active_at": a.get("activeAt", ""),
            "value": a.get("value", ""),
            "labels": a.get("labels", {}),
        }
        for a in alerts
    ]
    return sorted(out, key=lambda a: (a["state"] != "firing", a["name"]))
