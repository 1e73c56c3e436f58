"""Control routes: health, model and server info, pause/continue/abort, and /metrics."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from rlmesh.engine.protocol import ack, bad_request, body_of
from rlmesh.engine.sampling import parse_sampling_params
from rlmesh.engine.state import state_of

router = APIRouter()


@router.get("/health")
async def health() -> Any:
    return PlainTextResponse("")


@router.get("/health_generate")
async def health_generate(req: Request) -> Any:
    state = state_of(req)
    if state.weights.tainted:
        return PlainTextResponse(
            f"{len(state.weights.tainted)} parameters half written by a failed update", 503
        )
    params = parse_sampling_params({"max_new_tokens": 1, "temperature": 0})
    request = await state.generate([[0]], params, f"health-{uuid.uuid4().hex[:8]}")
    if request.sequences[0].finish_reason.get("type") == "abort":
        return PlainTextResponse("generation failed", 503)
    return PlainTextResponse("")


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(req: Request) -> Any:
    state = state_of(req)
    return {
        "model_path": state.model_path,
        "tokenizer_path": state.model_path if state.tokenizer is not None else None,
        "is_generation": True,
        "weight_version": state.engine.weight_version,
        "vocab_size": state.vocab_size,
        "max_batch_size": state.max_batch_size,
        "engine": "embedded",
        "device": "cpu",  # SGLang's key: the learner's weight group is gloo for it
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(req: Request) -> Any:
    state = state_of(req)
    engine, weights = state.engine, state.weights
    return {
        "engine": "embedded",
        "device": "cpu",  # SGLang's key: the learner's weight group is gloo for it
        "running": engine.running,
        "waiting": engine.waiting,
        "paused": engine.paused,
        "weight_version": engine.weight_version,
        "tokens_generated": engine.tokens_generated,
        "busy_s": engine.busy_s,
        # Wall-clock (start, end) periods of model compute, for cross-service overhead sums.
        "busy_intervals": engine.busy.intervals(),
        "weights_direct_updates": weights.direct_updates,
        "weights_receiving_direct": weights.receiving_direct,
        "weights_tainted": len(weights.tainted),
    }


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache() -> Any:
    # No prefix cache to flush: every request prefills from scratch.
    return PlainTextResponse("Cache flushed.")


@router.post("/pause_generation")
async def pause_generation(req: Request) -> Any:
    state = state_of(req)
    state.engine.pause()
    return ack(True, "paused")


@router.post("/continue_generation")
async def continue_generation(req: Request) -> Any:
    state = state_of(req)
    state.engine.resume()
    return ack(True, "continued")


@router.post("/abort_request")
async def abort_request(req: Request) -> Any:
    state = state_of(req)
    try:
        body = await body_of(req)
    except ValueError as e:
        return bad_request(str(e))
    n = state.engine.abort(None if body.get("abort_all") else str(body.get("rid", "")))
    return ack(True, f"aborted {n} request(s)")


@router.get("/metrics")
async def prometheus(req: Request) -> Any:
    state = state_of(req)
    return PlainTextResponse(state.metrics.scrape(state.engine), media_type="text/plain; version=0.0.4")
