"""``EngineState``: what the engine's routes share (the batch engine, its weights and metrics, the
model's facts), built once per app and read by each route with ``state_of(request)``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from fastapi import Request
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from rlmesh.engine.batching import BatchEngine, GenerationRequest
from rlmesh.engine.metrics import EngineMetrics
from rlmesh.engine.sampling import SamplingParams
from rlmesh.engine.simulated import SimulatedModel, read_simulation_spec, simulation_spec
from rlmesh.engine.weight_updates import EngineWeights, WeightUpdateError
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.runtime.threads import run_in_daemon_thread

T = TypeVar("T")


@dataclass
class EngineState:
    model_path: str
    max_batch_size: int
    weight_sync_timeout_s: float
    engine: BatchEngine
    weights: EngineWeights
    metrics: EngineMetrics
    tokenizer: PreTrainedTokenizerBase | None
    vocab_size: int
    context: int
    loop: asyncio.AbstractEventLoop | None = None  # the app's, once it started
    weight_waits: set[asyncio.Future[Any]] = field(default_factory=set)

    async def off_loop_for_peers(self, fn: Callable[..., T], *args: object, name: str) -> T:
        """``fn(*args)`` in a daemon thread: a weight group's rendezvous or receive, which waits for
        its peers up to the group's deadline. ``stopping`` abandons the wait (WeightUpdateError)."""
        waiting = run_in_daemon_thread(fn, *args, name=name)
        self.weight_waits.add(waiting)
        try:
            return await waiting
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if waiting.cancelled() and task is not None and not task.cancelling():
                raise WeightUpdateError(
                    "the engine is stopping: it no longer waits for its weight group"
                ) from None
            raise
        finally:
            self.weight_waits.discard(waiting)

    def stopping(self) -> None:
        """From the SIGTERM handler: a shutdown waits for requests in flight, and one waiting on a
        group whose peers never come would hold it up to the group's deadline."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._abandon_weight_waits)

    def _abandon_weight_waits(self) -> None:
        for waiting in list(self.weight_waits):
            waiting.cancel()

    async def generate(self, prompts: list[list[int]], params: SamplingParams, rid: str) -> GenerationRequest:
        """Runs one request on the engine's thread; resolves when its last sequence finishes."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[GenerationRequest] = loop.create_future()
        request = GenerationRequest(
            rid=rid,
            prompts=prompts,
            params=params,
            on_done=lambda r: loop.call_soon_threadsafe(done.set_result, r),
        )
        self.engine.submit(request)
        return await done


def load_state(
    model_path: str,
    *,
    max_batch_size: int,
    weight_version: str,
    skip_tokenizer_init: bool,
    weight_sync_timeout_s: float,
    override_config: dict[str, Any] | None = None,
) -> EngineState:
    """Loads the model (float32, for CPU) and its tokenizer and builds an engine on them, not started.
    ``override_config``: entries that replace the model's HF config ones (SGLang's
    ``--json-model-override-args``; verl's ``model.override_config``). A directory
    ``write_simulated_model`` wrote gives a simulated engine (no model, no tokenizer; the overrides
    replace its spec's entries)."""
    spec = read_simulation_spec(model_path)
    if spec is not None:
        where = "--json-model-override-args (actor_rollout_ref.model.override_config)"
        model: Any = SimulatedModel(simulation_spec(dict(override_config or {}), where, spec))
    else:
        config = AutoConfig.from_pretrained(model_path)
        for key, value in (override_config or {}).items():
            setattr(config, key, value)
        model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32)
    tokenizer = None
    if not skip_tokenizer_init and spec is None:
        with contextlib.suppress(Exception):  # a model directory without a tokenizer is fine
            tokenizer = load_tokenizer(model_path)
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = eos if eos is not None else model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else None
    engine = BatchEngine(
        model,
        eos_token_ids=eos_ids,
        max_batch_size=max_batch_size,
        decode_text=decode,
        weight_version=weight_version,
    )
    return EngineState(
        model_path=model_path,
        max_batch_size=max_batch_size,
        weight_sync_timeout_s=weight_sync_timeout_s,
        engine=engine,
        weights=EngineWeights(model),
        metrics=EngineMetrics(),
        tokenizer=tokenizer,
        vocab_size=model.config.vocab_size,
        # Models that declare no context are not limited by it.
        context=int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30),
    )


def state_of(request: Request) -> EngineState:
    # Read directly, not through Depends: FastAPI's dependency solving costs ~0.1 ms a request here.
    return request.app.state.engine_state
