"""Generation in chunks of ``rlmesh.sampler.partial_chunk_tokens``: each sample's tokens, log-probs and
versions so far (a ``PartialSample``) grow by one engine call per chunk and are saved with the task
after each, so an interrupted generation goes on from them. docs/reliability.md#partial-rollouts"""

from __future__ import annotations

from typing import Any

from rlmesh.engine.client import TOKEN_VERSIONS, EngineError
from rlmesh.queue.partials import PartialSample

# Not SGLang's: on an output put together from chunks, how many of its tokens an earlier replica made.
RESUMED_TOKENS = "rlmesh_resumed_tokens"
# Sampling settings whose meaning a cut between chunks would change: stop strings are matched on the
# text of one call's output, penalties count one call's output tokens, a seed restarts each call.
UNCUTTABLE = ("stop", "repetition_penalty", "frequency_penalty", "presence_penalty", "sampling_seed")
NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def chunk_problem(params: dict[str, Any]) -> str | None:
    """Why a request with SGLang ``params`` must be generated in one call, or None."""
    if "max_new_tokens" not in params:
        return "no max_new_tokens"
    for name in UNCUTTABLE:
        if name in params and params[name] not in (None, [], NEUTRAL.get(name)):
            return f"sampling_params.{name} is set"
    return None


def chunk_params(params: dict[str, Any], sample: PartialSample, chunk_tokens: int) -> dict[str, Any]:
    """The params of ``sample``'s next call: one sample, at most ``chunk_tokens`` more tokens, within
    the task's max_new_tokens; min_new_tokens less what it has."""
    have = len(sample.output_ids)
    out = {**params, "n": 1, "max_new_tokens": min(chunk_tokens, params["max_new_tokens"] - have)}
    if params.get("min_new_tokens"):
        out["min_new_tokens"] = max(0, min(out["max_new_tokens"], params["min_new_tokens"] - have))
    return out


def extend(sample: PartialSample, output: dict[str, Any], versions: list[int], max_new_tokens: int) -> None:
    """Adds one call's ``output`` (SGLang's answer, with log-probs) to ``sample``; ``versions``: the
    weight version of each of its tokens. An abort keeps what it generated: the next call goes on
    from it. Sets ``finish_reason`` once the sample is complete. EngineError for an answer that
    cannot be added (log-probs missing, a finish reason SGLang does not give)."""
    ids = list(output["output_ids"])
    meta = output["meta_info"]
    logprobs = [lp for lp, _, _ in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(ids) or len(versions) != len(ids):
        raise EngineError(
            f"a chunk of {len(ids)} tokens came with {len(logprobs)} log-probs and {len(versions)} versions",
            status=500,
        )
    reason = meta.get("finish_reason") or {}
    kind = str(reason.get("type", "")) if isinstance(reason, dict) else str(reason)
    if kind not in ("stop", "length", "abort"):
        raise EngineError(f"a chunk finished with {kind!r}, not stop, length or abort", status=500)
    sample.output_ids.extend(ids)
    sample.log_probs.extend(logprobs)
    sample.token_policy_versions.extend(versions)
    if kind == "abort":  # interrupted: what it has is kept, and counts as resumed from
        sample.resumed_tokens = len(sample.output_ids)
    if kind == "stop":
        sample.finish_reason = "stop"
    elif len(sample.output_ids) >= max_new_tokens:
        sample.finish_reason = "length"


def resumed_from(saved: PartialSample | None, taken_over: bool = True) -> PartialSample:
    """A sample to go on with: ``saved``, or a new one. ``taken_over``: another process generated
    ``saved``, whose tokens all count as resumed then; else it keeps its own count."""
    sample = PartialSample()
    if saved is not None:
        sample.CopyFrom(saved)
        if taken_over:
            sample.resumed_tokens = len(saved.output_ids)
    return sample


def as_output(sample: PartialSample) -> dict[str, Any]:
    """A complete ``sample`` as SGLang would have answered it in one call (with log-probs)."""
    versions = list(sample.token_policy_versions)
    return {
        "output_ids": list(sample.output_ids),
        "meta_info": {
            "finish_reason": {"type": sample.finish_reason},
            "weight_version": str(max(versions)) if versions else "default",
            "output_token_logprobs": [
                [lp, t, None] for lp, t in zip(sample.log_probs, sample.output_ids, strict=True)
            ],
            "completion_tokens": len(sample.output_ids),
            TOKEN_VERSIONS: versions,
            RESUMED_TOKENS: sample.resumed_tokens,
        },
    }
