"""The reward services replicas call: the list in force, and adding, swapping or removing one
mid-run. docs/control.md#swapping-a-reward-service"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from pydantic import Field

from rlmesh.control import fleet
from rlmesh.control.deps import API, Strict, audited, plane_of
from rlmesh.control.errors import ControlError
from rlmesh.control.plane import ControlPlane

router = APIRouter(prefix=API, tags=["rewards"])


class RewardAddBody(Strict):
    address: str = Field(max_length=300, description="host:port of a reward service")
    force: bool = Field(False, description="add it even if its gRPC health is not SERVING")


class RewardSwapBody(Strict):
    addresses: list[Annotated[str, Field(max_length=300)]] = Field(
        min_length=1, max_length=64, description="the new list of reward services (host:port)"
    )
    force: bool = Field(False, description="swap even if one is not SERVING")


async def current_rewards(plane: ControlPlane) -> tuple[list[str], str]:
    """The run's list in Redis, else the config's; and which of the two it is."""
    return await fleet.reward_addresses(plane.redis, plane.keys, plane.cfg.rlmesh.reward.client_addresses())


async def swap_to(request: Request, action: str, new: list[str], force: bool, field: str) -> dict[str, Any]:
    """Writes ``new`` as the list (each address not in the old one SERVING, unless ``force``) and
    audits the change."""
    plane = plane_of(request)
    old, _ = await current_rewards(plane)
    if not force:
        await fleet.require_serving([a for a in new if a not in old], field)
    stored = await fleet.set_rewards(plane.redis, plane.keys, new)
    await plane.audit.record(audited(request, action), action, target="rewards", old=old, new=stored)
    return {"addresses": stored}


@router.get("/rewards")
async def rewards(request: Request) -> dict[str, Any]:
    """The reward services replicas call now (the run's list in Redis, else the config's), each
    with its health and functions."""
    plane = plane_of(request)
    addresses, source = await current_rewards(plane)
    return {"source": source, "rewards": await fleet.list_rewards(addresses, plane.token)}


@router.post("/rewards")
async def add_reward(request: Request, body: RewardAddBody) -> dict[str, Any]:
    """Adds a reward service to the list; replicas spread their calls over it within a second."""
    address = fleet.checked_addresses([body.address], "address")[0]
    old, _ = await current_rewards(plane_of(request))
    if address in old:
        raise ControlError(409, f"address: {address} is already in the list")
    return await swap_to(request, "add_reward", [*old, address], body.force, "address")


@router.put("/rewards")
async def swap_rewards(request: Request, body: RewardSwapBody) -> dict[str, Any]:
    """Replaces the whole list in one atomic write: a swap mid-run. Calls in flight finish where
    they are, a failed one is retried on the new list: no sample is lost."""
    new = fleet.checked_addresses(body.addresses, "addresses")
    return await swap_to(request, "swap_rewards", new, body.force, "addresses")


@router.delete("/rewards/{address}")
async def remove_reward(request: Request, address: Annotated[str, Path(max_length=300)]) -> dict[str, Any]:
    old, _ = await current_rewards(plane_of(request))
    if address not in old:
        raise ControlError(404, f"address: {address!r} is not in the list {old}")
    if len(old) == 1:
        raise ControlError(409, f"address: {address} is the only reward service; swap instead")
    return await swap_to(request, "remove_reward", [a for a in old if a != address], True, "address")
