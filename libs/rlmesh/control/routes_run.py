"""The run: its status, metrics history, validations and resolved config, and the actions on it
(pause, resume, checkpoint, stop)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from pydantic import Field

from rlmesh.control.deps import API, Strict, audited, plane_of
from rlmesh.control.errors import ControlError

router = APIRouter(prefix=API)


class StopBody(Strict):
    checkpoint: bool = Field(True, description="checkpoint before exiting, so the run can resume from it")


@router.get("/run/status", tags=["run"])
async def run_status(request: Request) -> dict[str, Any]:
    """Step, policy version, phase, ETA (mean of the last steps' times), live
    hyper-parameters and the last step's metrics."""
    return await plane_of(request).status()


@router.get("/run/metrics", tags=["run"])
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


@router.get("/run/metrics/keys", tags=["run"])
async def run_metric_keys(request: Request) -> dict[str, list[str]]:
    rows = await plane_of(request).history(start=0)
    names = sorted({k for row in rows[-5:] for k in row["metrics"]})
    return {"keys": names}


@router.get("/run/validation", tags=["run"])
async def run_validation(request: Request) -> dict[str, Any]:
    """Every validation's ``val/*`` metrics, by step (0: before training)."""
    return {"rows": await plane_of(request).history(prefix="val/")}


@router.get("/run/config", tags=["run"])
async def run_config(request: Request) -> dict[str, Any]:
    """The config as the learner resolved it, secrets removed."""
    return await plane_of(request).resolved_config()


@router.post("/run/pause", tags=["actions"])
async def pause(request: Request) -> dict[str, Any]:
    """The learner finishes its current step, then holds."""
    return await plane_of(request).action(audited(request, "pause"), "pause")


@router.post("/run/resume", tags=["actions"])
async def resume(request: Request) -> dict[str, Any]:
    return await plane_of(request).action(audited(request, "resume"), "resume")


@router.post("/run/checkpoint", tags=["actions"])
async def checkpoint(request: Request) -> dict[str, Any]:
    """A checkpoint at the next step boundary (at once while paused); answers with its path."""
    return await plane_of(request).action(audited(request, "checkpoint"), "checkpoint")


@router.post("/run/stop", tags=["actions"])
async def stop(request: Request, body: Annotated[StopBody | None, Body()] = None) -> dict[str, Any]:
    """Graceful stop: the learner ends its step, checkpoints (unless told not to) and exits; the
    same command resumes the run from that checkpoint."""
    keep = body.checkpoint if body is not None else True
    return await plane_of(request).action(audited(request, "stop"), "stop", checkpoint=keep)
