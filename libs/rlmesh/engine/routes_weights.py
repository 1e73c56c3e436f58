"""Weight-update routes, as SGLang names them: a process group for broadcasts from the learner,
loads from it or from disk, reads of one parameter, and the weight version."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request

from rlmesh.engine.protocol import ack, bad_request, body_of
from rlmesh.engine.state import EngineState, state_of
from rlmesh.engine.weight_updates import WeightUpdateError, check_load_format

log = logging.getLogger("rlmesh.engine")
router = APIRouter()


def set_version(state: EngineState, body: dict[str, Any]) -> None:
    """An update's ``weight_version``, when it names one, becomes the engine's."""
    if body.get("weight_version") is not None:
        state.engine.weight_version = str(body["weight_version"])


def receive_and_load(state: EngineState, b: dict[str, Any], load_format: str | None) -> None:
    """Receives one broadcast into the model; runs off the event loop."""
    engine, weights = state.engine, state.weights
    group = str(b.get("group_name", "weight_update_group"))
    span = weights.direct_span(b["names"], b["dtypes"], b["shapes"], load_format)
    if span is not None:
        # Straight into the parameters, so generation holds for the transfer.
        with engine.exclusive():
            try:
                weights.receive_direct(b["names"], span, group)
            finally:
                engine.hold(bool(weights.tainted))
            set_version(state, b)
        return
    with (
        weights.receiving(b["names"], b["dtypes"], b["shapes"], group, load_format) as received,
        engine.exclusive(),
    ):
        weights.load(received, strict=False)
        engine.hold(bool(weights.tainted))
        set_version(state, b)


def load_from_disk(state: EngineState, b: dict[str, Any]) -> None:
    with state.engine.exclusive():
        state.weights.load_from_disk(str(b["model_path"]))
        state.engine.hold(bool(state.weights.tainted))
        set_version(state, b)


@router.post("/init_weights_update_group")
async def init_weights_update_group(req: Request) -> Any:
    state = state_of(req)
    try:
        b = await body_of(req, "master_address", "master_port", "rank_offset", "world_size")
        await state.off_loop_for_peers(
            state.weights.init_group,
            str(b["master_address"]),
            int(b["master_port"]),
            int(b["rank_offset"]),
            int(b["world_size"]),
            str(b.get("group_name", "weight_update_group")),
            str(b.get("backend", "gloo")),
            float(b.get("timeout_s", state.weight_sync_timeout_s)),
            name="weight-group",
        )
    except Exception as e:
        return ack(False, f"init_weights_update_group failed: {e}")
    return ack(True, "Succeeded to initialize custom process group.")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(req: Request) -> Any:
    state = state_of(req)
    try:
        b = await body_of(req, "names", "dtypes", "shapes")
        load_format = b.get("load_format")
        check_load_format(load_format)  # before the thread hop: a bad value is answered at once
        await state.off_loop_for_peers(receive_and_load, state, b, load_format, name="weight-receive")
    except Exception as e:
        state.metrics.weight_updates.labels("distributed", "failed").inc()
        log.error("update_weights_from_distributed failed: %s", e)
        return ack(False, f"update_weights_from_distributed failed: {e}")
    state.metrics.weight_updates.labels("distributed", "ok").inc()
    return ack(True, f"Succeeded to update parameter online (weight_version {state.engine.weight_version}).")


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(req: Request) -> Any:
    state = state_of(req)
    try:
        b = await body_of(req, "model_path")
        await asyncio.to_thread(load_from_disk, state, b)
    except Exception as e:
        state.metrics.weight_updates.labels("disk", "failed").inc()
        return ack(False, f"update_weights_from_disk failed: {e}")
    state.metrics.weight_updates.labels("disk", "ok").inc()
    return ack(True, f"Succeeded to update model weights (weight_version {state.engine.weight_version}).")


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(req: Request) -> Any:
    state = state_of(req)
    try:
        b = await body_of(req)
        group = str(b.get("group_name", "weight_update_group"))
        await asyncio.to_thread(state.weights.destroy_group, group)
    except Exception as e:
        return ack(False, f"destroy_weights_update_group failed: {e}")
    return ack(True, "Succeeded to destroy custom process group.")


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(req: Request) -> Any:
    state = state_of(req)
    try:
        b = await body_of(req, "name")
        name, truncate = b["name"], b.get("truncate_size", 100)
        if not isinstance(name, str):
            raise ValueError(f"name: expected a parameter name (a string), got {name!r}")
        if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < 0:
            raise ValueError(f"truncate_size={truncate!r}: expected an integer >= 0 (0 = all)")
        with state.engine.exclusive():
            return state.weights.get(name, truncate)
    except WeightUpdateError as e:
        return bad_request(f"name={b['name']!r}: {e}")
    except ValueError as e:
        return bad_request(str(e))


@router.post("/update_weight_version")
async def update_weight_version(req: Request) -> Any:
    state = state_of(req)
    try:
        b = await body_of(req, "new_version")
    except ValueError as e:
        return bad_request(str(e))
    state.engine.weight_version = str(b["new_version"])
    return ack(True, f"weight_version is {state.engine.weight_version}")
