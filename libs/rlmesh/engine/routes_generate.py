"""``POST /generate``: SGLang's native generation endpoint, input_ids in, output_ids out."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from rlmesh.engine.batching import DuplicateRequestError, GenerationRequest
from rlmesh.engine.client import TOKEN_VERSIONS
from rlmesh.engine.protocol import bad_request, body_of, check_generate_limits, parse_input_ids
from rlmesh.engine.sampling import SamplingParamsError, parse_sampling_params
from rlmesh.engine.state import EngineState, state_of

router = APIRouter()


def render(state: EngineState, request: GenerationRequest, return_logprob: bool) -> list[dict[str, Any]]:
    """One SGLang answer per sequence, prompt-major."""
    outs = []
    for seq in request.sequences:
        meta: dict[str, Any] = {
            "id": request.rid if len(request.sequences) == 1 else f"{request.rid}-{seq.index}",
            "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": 0,
            "weight_version": request.weight_version,
            "e2e_latency": (request.finished_at or time.perf_counter()) - request.created,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(seq.logprobs, seq.output_ids, strict=True)
            ]
            # Not SGLang's: the weight version each token was sampled with (docs/sglang.md).
            meta[TOKEN_VERSIONS] = list(seq.versions)
        out: dict[str, Any] = {"output_ids": seq.output_ids, "meta_info": meta}
        if state.tokenizer is not None:
            out["text"] = state.tokenizer.decode(
                seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens
            )
        outs.append(out)
    return outs


@router.post("/generate")
async def generate(req: Request) -> Any:
    state = state_of(req)
    try:
        body = await body_of(req)
        if body.get("stream"):
            raise ValueError("stream=true is not supported by the embedded engine")
        prompts, batched = parse_input_ids(body, state.vocab_size)
        sp_raw = body.get("sampling_params") or {}
        if isinstance(sp_raw, list):
            raise ValueError("one sampling_params per batch item is not supported; send one dict")
        params = parse_sampling_params(sp_raw)
        if params.stop and state.tokenizer is None:
            raise ValueError("sampling_params.stop needs a tokenizer; this engine runs without one")
        check_generate_limits(prompts, params, batched, state.context)
    except (ValueError, SamplingParamsError) as e:
        return bad_request(str(e))
    rid = str(body.get("rid") or uuid.uuid4().hex)
    try:
        request = await state.generate(prompts, params, rid)
    except DuplicateRequestError as e:
        return bad_request(str(e))
    metrics = state.metrics
    metrics.prompt_tokens.inc(sum(map(len, prompts)) * params.n)
    outs = render(state, request, bool(body.get("return_logprob")))
    metrics.tokens.inc(sum(o["meta_info"]["completion_tokens"] for o in outs))
    metrics.batch_size.observe(len(outs))
    for o in outs:
        metrics.requests.labels(o["meta_info"]["finish_reason"]["type"]).inc()
    metrics.latency.observe(time.perf_counter() - request.created)
    return outs if batched or params.n > 1 else outs[0]
