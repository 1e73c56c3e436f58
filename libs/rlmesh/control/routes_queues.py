"""The run's queues: each stream's depth, the dead letters, and replaying one."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request

from rlmesh.control import fleet
from rlmesh.control.deps import API, audited, plane_of

router = APIRouter(prefix=API, tags=["queues"])

DEAD_LETTER_ID = r"^\d{1,20}-\d{1,20}$"


@router.get("/queues")
async def queues(request: Request) -> dict[str, Any]:
    """Each stream's length, entries handed out and not acked (pending), and the dead letters."""
    plane = plane_of(request)
    return await fleet.queue_depths(plane.redis, plane.keys)


@router.get("/dead-letters")
async def dead_letters(
    request: Request, limit: Annotated[int, Query(ge=1, le=10_000)] = 100
) -> dict[str, Any]:
    plane = plane_of(request)
    return {"dead_letters": await fleet.dead_letters(plane.redis, plane.keys, limit)}


@router.post("/dead-letters/{dead_letter_id}/replay")
async def replay(
    request: Request,
    dead_letter_id: Annotated[str, Path(pattern=DEAD_LETTER_ID, max_length=41)],
) -> dict[str, Any]:
    """Puts a dead letter back on its queue as a new entry and removes it from the dead letters."""
    plane = plane_of(request)
    result = await fleet.replay_dead_letter(plane.redis, plane.keys, dead_letter_id)
    await plane.audit.record(
        audited(request, "replay_dead_letter"),
        "replay_dead_letter",
        target=dead_letter_id,
        new=result["new_entry_id"],
        detail=result["stream"],
    )
    return result
