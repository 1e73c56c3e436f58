"""The dashboard: one static page at ``/dashboard/`` (``/`` leads there), its script, style and the
vendored uPlot; no build step. The files are open like ``/health`` (they hold nothing of the run);
the page asks for the run's token and sends it with each API call. docs/control.md#dashboard"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from rlmesh.runtime.http_auth import OPEN_PATHS

STATIC = Path(__file__).parent / "static"
PREFIX = "/dashboard"


def open_paths() -> frozenset[str]:
    """The exact paths the bearer token does not guard: every HTTP service's (``/health``, ``/metrics``)
    and the page's files, each by name (no prefix: nothing added under it later opens by accident)."""
    files = {f"{PREFIX}/{p.relative_to(STATIC).as_posix()}" for p in STATIC.rglob("*") if p.is_file()}
    return OPEN_PATHS | {"/", PREFIX, f"{PREFIX}/", *files}


def mount_dashboard(app: FastAPI) -> None:
    """Adds the page to ``app``; its API calls go to ``/api/v1`` of the same origin."""

    async def to_page(request: Request) -> RedirectResponse:
        query = f"?{request.url.query}" if request.url.query else ""  # the page's settings (poll_ms)
        return RedirectResponse(f"{PREFIX}/{query}")

    app.add_api_route("/", to_page, include_in_schema=False)
    app.add_api_route(PREFIX, to_page, include_in_schema=False)

    app.mount(PREFIX, StaticFiles(directory=STATIC, html=True), name="dashboard")
