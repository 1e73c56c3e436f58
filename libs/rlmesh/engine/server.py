"""``rlmesh engine``: the embedded CPU engine as an HTTP server speaking SGLang's native API.

Implements the subset in shared/notes/sglang-api.md — /generate, /health, /health_generate,
/get_model_info, /flush_cache, /pause_generation, /continue_generation, /abort_request, the
weight-update endpoints and /metrics — so the rollout service and the learner use one client for
this engine and for a real SGLang server. Errors are 400 with ``{"error": {"message": ...}}``
(generate) or ``{"success": false, "message": ...}`` (control), as SGLang answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from rlmesh.runtime.entry import limit_torch_threads

limit_torch_threads()

import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402

from rlmesh.engine.batching import BatchEngine, DuplicateRequestError, GenerationRequest  # noqa: E402
from rlmesh.engine.sampling import SamplingParamsError, parse_sampling_params  # noqa: E402
from rlmesh.engine.weight_updates import EngineWeights, WeightUpdateError, check_load_format  # noqa: E402
from rlmesh.runtime.logs import configure_logging  # noqa: E402

log = logging.getLogger("rlmesh.engine")


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "rlmesh_engine_requests", "/generate requests finished", ["finish"], registry=registry
        )
        self.tokens = Counter("rlmesh_engine_generated_tokens", "Tokens generated", registry=registry)
        self.prompt_tokens = Counter(
            "rlmesh_engine_prompt_tokens", "Prompt tokens prefilled", registry=registry
        )
        self.latency = Histogram(
            "rlmesh_engine_request_latency_seconds",
            "/generate latency",
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.running = Gauge("rlmesh_engine_running_sequences", "Sequences decoding now", registry=registry)
        self.busy = Gauge(
            "rlmesh_engine_busy_seconds", "Seconds spent in model forwards since start", registry=registry
        )
        self.waiting = Gauge(
            "rlmesh_engine_waiting_sequences", "Sequences waiting for a batch slot", registry=registry
        )
        self.weight_updates = Counter(
            "rlmesh_engine_weight_updates", "Weight updates", ["source", "outcome"], registry=registry
        )


def bad_request(message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "code": 400}, "success": False, "message": message}, 400
    )


def ack(success: bool, message: str = "") -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, 200 if success else 400)


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


MAX_BODY_BYTES = 64 << 20
# Sequences one request may ask for (prompts x n): each holds a KV cache and a batch slot.
MAX_SEQUENCES_PER_REQUEST = 4096


def check_generate_limits(prompts: list[list[int]], params: Any, batched: bool, context: int) -> None:
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


def create_app(
    model_path: str,
    *,
    max_batch_size: int = 64,
    weight_version: str = "default",
    skip_tokenizer_init: bool = False,
    weight_sync_timeout_s: float = 600.0,
    ready_file: str | None = None,
    port_holder: dict[str, int] | None = None,
) -> FastAPI:
    from transformers import AutoModelForCausalLM

    from rlmesh.models.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = None
    if not skip_tokenizer_init:
        with contextlib.suppress(Exception):  # a model directory without a tokenizer is fine
            tokenizer = load_tokenizer(model_path)
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = eos if eos is not None else model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    vocab_size = model.config.vocab_size
    context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else None
    engine = BatchEngine(
        model,
        eos_token_ids=eos_ids,
        max_batch_size=max_batch_size,
        decode_text=decode,
        weight_version=weight_version,
    )
    weights = EngineWeights(model)
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if ready_file:
            info = {"pid": os.getpid(), "port": (port_holder or {}).get("port"), "model_path": model_path}
            tmp = Path(ready_file + ".tmp")
            tmp.write_text(json.dumps(info))
            tmp.replace(ready_file)
        log.info("engine ready", extra={"model_path": model_path, "max_batch_size": max_batch_size})
        yield
        engine.stop()
        log.info("engine stopped")

    app = FastAPI(title="rlmesh embedded engine", lifespan=lifespan)
    app.state.engine = engine

    async def run_generate(prompts: list[list[int]], params: Any, rid: str) -> GenerationRequest:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[GenerationRequest] = loop.create_future()
        request = GenerationRequest(
            rid=rid,
            prompts=prompts,
            params=params,
            on_done=lambda r: loop.call_soon_threadsafe(done.set_result, r),
        )
        engine.submit(request)
        return await done

    def render(request: GenerationRequest, return_logprob: bool) -> list[dict[str, Any]]:
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
            out: dict[str, Any] = {"output_ids": seq.output_ids, "meta_info": meta}
            if decode is not None:
                out["text"] = tokenizer.decode(
                    seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens
                )
            outs.append(out)
        return outs

    @app.post("/generate")
    async def generate(req: Request) -> Any:
        try:
            body = await body_of(req)
            if body.get("stream"):
                raise ValueError("stream=true is not supported by the embedded engine")
            prompts, batched = parse_input_ids(body, vocab_size)
            sp_raw = body.get("sampling_params") or {}
            if isinstance(sp_raw, list):
                raise ValueError("one sampling_params per batch item is not supported; send one dict")
            params = parse_sampling_params(sp_raw)
            if params.stop and decode is None:
                raise ValueError("sampling_params.stop needs a tokenizer; this engine runs without one")
            check_generate_limits(prompts, params, batched, context)
        except (ValueError, SamplingParamsError) as e:
            return bad_request(str(e))
        rid = str(body.get("rid") or uuid.uuid4().hex)
        try:
            request = await run_generate(prompts, params, rid)
        except DuplicateRequestError as e:
            return bad_request(str(e))
        metrics.prompt_tokens.inc(sum(map(len, prompts)) * params.n)
        outs = render(request, bool(body.get("return_logprob")))
        metrics.tokens.inc(sum(o["meta_info"]["completion_tokens"] for o in outs))
        for o in outs:
            metrics.requests.labels(o["meta_info"]["finish_reason"]["type"]).inc()
        metrics.latency.observe(time.perf_counter() - request.created)
        return outs if batched or params.n > 1 else outs[0]

    @app.get("/health")
    async def health() -> Any:
        return PlainTextResponse("")

    @app.get("/health_generate")
    async def health_generate() -> Any:
        if weights.tainted:
            return PlainTextResponse(
                f"{len(weights.tainted)} parameters half written by a failed update", 503
            )
        params = parse_sampling_params({"max_new_tokens": 1, "temperature": 0})
        request = await run_generate([[0]], params, f"health-{uuid.uuid4().hex[:8]}")
        if request.sequences[0].finish_reason.get("type") == "abort":
            return PlainTextResponse("generation failed", 503)
        return PlainTextResponse("")

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> Any:
        return {
            "model_path": model_path,
            "tokenizer_path": model_path if tokenizer else None,
            "is_generation": True,
            "weight_version": engine.weight_version,
            "vocab_size": vocab_size,
            "max_batch_size": max_batch_size,
            "engine": "embedded",
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> Any:
        return {
            "engine": "embedded",
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

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Any:
        # No prefix cache to flush: every request prefills from scratch.
        return PlainTextResponse("Cache flushed.")

    @app.post("/pause_generation")
    async def pause_generation() -> Any:
        engine.pause()
        return ack(True, "paused")

    @app.post("/continue_generation")
    async def continue_generation() -> Any:
        engine.resume()
        return ack(True, "continued")

    @app.post("/abort_request")
    async def abort_request(req: Request) -> Any:
        try:
            body = await body_of(req)
        except ValueError as e:
            return bad_request(str(e))
        n = engine.abort(None if body.get("abort_all") else str(body.get("rid", "")))
        return ack(True, f"aborted {n} request(s)")

    async def body_of(req: Request, *required: str) -> dict[str, Any]:
        declared = req.headers.get("content-length", "")
        size = int(declared) if declared.isdigit() else 0
        if size <= MAX_BODY_BYTES:  # a declared size past the limit is refused before reading it
            raw = await req.body()
            size = len(raw)
        if size > MAX_BODY_BYTES:
            raise ValueError(f"request body is {size} bytes; this engine takes at most {MAX_BODY_BYTES}")
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

    def set_version(body: dict[str, Any]) -> None:
        """An update's ``weight_version``, when it names one, becomes the engine's."""
        if body.get("weight_version") is not None:
            engine.weight_version = str(body["weight_version"])

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: Request) -> Any:
        try:
            b = await body_of(req, "master_address", "master_port", "rank_offset", "world_size")
            await asyncio.to_thread(
                weights.init_group,
                str(b["master_address"]),
                int(b["master_port"]),
                int(b["rank_offset"]),
                int(b["world_size"]),
                str(b.get("group_name", "weight_update_group")),
                str(b.get("backend", "gloo")),
                float(b.get("timeout_s", weight_sync_timeout_s)),
            )
        except Exception as e:
            return ack(False, f"init_weights_update_group failed: {e}")
        return ack(True, "Succeeded to initialize custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: Request) -> Any:
        try:
            b = await body_of(req, "names", "dtypes", "shapes")
            load_format = b.get("load_format")
            check_load_format(load_format)  # before the thread hop: a bad value is answered at once

            def receive_and_load() -> None:
                group = str(b.get("group_name", "weight_update_group"))
                span = weights.direct_span(b["names"], b["dtypes"], b["shapes"], load_format)
                if span is not None:
                    # Straight into the parameters, so generation holds for the transfer.
                    with engine.exclusive():
                        try:
                            weights.receive_direct(b["names"], span, group)
                        finally:
                            engine.hold(bool(weights.tainted))
                        set_version(b)
                    return
                with (
                    weights.receiving(b["names"], b["dtypes"], b["shapes"], group, load_format) as received,
                    engine.exclusive(),
                ):
                    weights.load(received, strict=False)
                    engine.hold(bool(weights.tainted))
                    set_version(b)

            await asyncio.to_thread(receive_and_load)
        except Exception as e:
            metrics.weight_updates.labels("distributed", "failed").inc()
            log.error("update_weights_from_distributed failed: %s", e)
            return ack(False, f"update_weights_from_distributed failed: {e}")
        metrics.weight_updates.labels("distributed", "ok").inc()
        return ack(True, f"Succeeded to update parameter online (weight_version {engine.weight_version}).")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: Request) -> Any:
        try:
            b = await body_of(req, "model_path")

            def load() -> None:
                with engine.exclusive():
                    weights.load_from_disk(str(b["model_path"]))
                    engine.hold(bool(weights.tainted))
                    set_version(b)

            await asyncio.to_thread(load)
        except Exception as e:
            metrics.weight_updates.labels("disk", "failed").inc()
            return ack(False, f"update_weights_from_disk failed: {e}")
        metrics.weight_updates.labels("disk", "ok").inc()
        return ack(True, f"Succeeded to update model weights (weight_version {engine.weight_version}).")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: Request) -> Any:
        try:
            b = await body_of(req)
            await asyncio.to_thread(weights.destroy_group, str(b.get("group_name", "weight_update_group")))
        except Exception as e:
            return ack(False, f"destroy_weights_update_group failed: {e}")
        return ack(True, "Succeeded to destroy custom process group.")

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(req: Request) -> Any:
        try:
            b = await body_of(req, "name")
            name, truncate = b["name"], b.get("truncate_size", 100)
            if not isinstance(name, str):
                raise ValueError(f"name: expected a parameter name (a string), got {name!r}")
            if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < 0:
                raise ValueError(f"truncate_size={truncate!r}: expected an integer >= 0 (0 = all)")
            with engine.exclusive():
                return weights.get(name, truncate)
        except WeightUpdateError as e:
            return bad_request(f"name={b['name']!r}: {e}")
        except ValueError as e:
            return bad_request(str(e))

    @app.post("/update_weight_version")
    async def update_weight_version(req: Request) -> Any:
        try:
            b = await body_of(req, "new_version")
        except ValueError as e:
            return bad_request(str(e))
        engine.weight_version = str(b["new_version"])
        return ack(True, f"weight_version is {engine.weight_version}")

    @app.get("/metrics")
    async def prometheus() -> Any:
        metrics.running.set(engine.running)
        metrics.waiting.set(engine.waiting)
        metrics.busy.set(engine.busy_s)
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlmesh engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="HF model directory (AutoModelForCausalLM)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (see --ready-file)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument(
        "--weight-sync-timeout", type=float, default=600.0, help="seconds for any weight collective"
    )
    parser.add_argument("--ready-file", help="write {pid, port} as JSON here once serving")
    parser.add_argument("--log-format", choices=["json", "text"], default="json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    configure_logging("engine", os.environ.get("RLMESH_RUN_ID"), fmt=args.log_format)
    torch.manual_seed(args.seed)
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on connections accepted from a socket that
    # names it. Without it Nagle holds each response's body until the client ACKs the headers,
    # which a delayed ACK makes ~40 ms per request.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = {"port": sock.getsockname()[1]}
    app = create_app(
        args.model_path,
        max_batch_size=args.max_batch_size,
        weight_version=args.weight_version,
        skip_tokenizer_init=args.skip_tokenizer_init,
        weight_sync_timeout_s=args.weight_sync_timeout,
        ready_file=args.ready_file,
        port_holder=port,
    )
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30, access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
