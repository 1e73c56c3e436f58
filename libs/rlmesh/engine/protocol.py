"""Request parsing and validation for the engine's routes, and SGLang's two error shapes:
400 with ``{"error": {"message": ...}}`` (generate) or ``{"success": false, "message": ...}`` (control)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from rlmesh.engine.sampling import SamplingParams

# What the guard in front of the routes lets a body reach (app.py); past it: 413.
MAX_BODY_BYTES = 64 << 20
# Sequences one request may ask for (prompts x n): each holds a KV cache and a batch slot.
MAX_SEQUENCES_PER_REQUEST = 4096


def error_body(status: int, message: str) -> dict[str, Any]:
    # Both shapes at once, so SGLang clients of either kind read the message.
    return {"error": {"message": message, "code": status}, "success": False, "message": message}


def bad_request(message: str) -> JSONResponse:
    return JSONResponse(error_body(400, message), 400)


def ack(success: bool, message: str = "") -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, 200 if success else 400)


async def body_of(req: Request, *required: str) -> dict[str, Any]:
    """The JSON object in the body; raises ValueError if it is not an object or lacks one of
    ``required``. Its size is bounded as it streams in, by the app's guard (``MAX_BODY_BYTES``)."""
    raw = await req.body()
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise ValueError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    missing = [k for k in required if k not in body]
    if missing:
        raise ValueError(f"missing fields {missing}")
    return body


def parse_input_ids(body: dict[str, Any], vocab_size: int) -> tuple[list[list[int]], bool]:
    """Returns (prompts, batched); raises ValueError naming what is wrong."""
    if "text" in body and "input_ids" not in body:
        raise ValueError("this engine takes input_ids only (as SGLang with --skip-tokenizer-init)")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids: expected a non-empty list of token ids or a list of such lists")
    batched = isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p:
            raise ValueError(f"input_ids[{i}]: expected a non-empty list of token ids")
        for j, t in enumerate(p):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                where = f"input_ids[{i}][{j}]" if batched else f"input_ids[{j}]"
                raise ValueError(f"{where}={t!r}: token ids must be integers in [0, {vocab_size})")
    return prompts, batched


def check_generate_limits(
    prompts: list[list[int]], params: SamplingParams, batched: bool, context: int
) -> None:
    """Refuses, naming the field, what the engine could not serve: more sequences than
    ``MAX_SEQUENCES_PER_REQUEST``, or a prompt whose length plus ``max_new_tokens`` exceeds the
    model's context."""
    sequences = len(prompts) * params.n
    if sequences > MAX_SEQUENCES_PER_REQUEST:
        raise ValueError(
            f"{len(prompts)} prompt(s) x sampling_params.n={params.n} = {sequences} sequences; "
            f"at most {MAX_SEQUENCES_PER_REQUEST} per request"
        )
    for i, prompt in enumerate(prompts):
        if len(prompt) + params.max_new_tokens > context:
            raise ValueError(
                f"input_ids{f'[{i}]' if batched else ''}: {len(prompt)} tokens + sampling_params.max_new_tokens="
                f"{params.max_new_tokens} exceed the model's context of {context} tokens"
            )
