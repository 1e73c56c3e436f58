"""The audit log: who changed what, when, from which value to which."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from rlmesh.control.deps import API, plane_of

router = APIRouter(prefix=API, tags=["audit"])


@router.get("/audit")
async def audit(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    action: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    """Who changed what, when, from which value to which; newest first."""
    return {"entries": await plane_of(request).audit.entries(limit, action)}
