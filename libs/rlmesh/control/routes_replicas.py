"""The rollout replicas: the live ones, draining or removing one, and the autoscaler's decision."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Request
from pydantic import Field

from rlmesh.control import fleet
from rlmesh.control.deps import API, Strict, audited, plane_of
from rlmesh.control.errors import ControlError

router = APIRouter(prefix=API, tags=["replicas"])


class DrainBody(Strict):
    timeout_s: float = Field(60.0, gt=0, le=3600, description="how long in-flight tasks may take")


@router.get("/replicas")
async def replicas(request: Request) -> dict[str, Any]:
    """Every live replica: address, policy version, health, tokens/s, tasks in flight, last
    heartbeat."""
    plane = plane_of(request)
    return {"replicas": await fleet.list_replicas(plane.registry, plane.token)}


@router.get("/autoscale")
async def autoscale(request: Request) -> dict[str, Any]:
    """The autoscaler's settings (rlmesh.control.autoscale) and its last decision: the desired
    count, what the load called for and why, the rates it measured."""
    return plane_of(request).autoscale_view()


@router.post("/replicas/{replica_id}/drain")
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
        audited(request, "drain"),
        "drain",
        target=replica_id,
        old=reg.state,
        new="drained",
        detail=result["message"],
    )
    return {"replica_id": replica_id, **result}


@router.delete("/replicas/{replica_id}")
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
        audited(request, "remove_replica"),
        "remove_replica",
        target=replica_id,
        old=reg.grpc_address,
        new=None,
        detail=detail,
    )
    return {"replica_id": replica_id, "removed": True, "detail": detail}
