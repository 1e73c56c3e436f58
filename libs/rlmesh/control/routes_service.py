"""``/health`` and ``/metrics``: the probes and the scrape, open without the token."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest

from rlmesh.control.deps import metrics_of

router = APIRouter(tags=["service"])


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(request: Request) -> PlainTextResponse:
    return PlainTextResponse(generate_latest(metrics_of(request).registry).decode())
