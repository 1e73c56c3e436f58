"""Reference service: per-token log-probs of responses under the frozen reference policy.

A thin shell over ``rlmesh.reference.ReferenceModel``. The model is ``actor_rollout_ref.model.path``
(verl: the reference is the initial actor); fp32 on CPU, bf16 on GPU. Each call is packed into
micro-batches of at most ``actor_rollout_ref.ref.log_prob_max_token_len_per_gpu`` padded tokens (and
``ref.log_prob_micro_batch_size_per_gpu`` rows when set); logits are divided by
``actor_rollout_ref.rollout.temperature`` as in verl. Forwards run one at a time in a worker thread,
so health stays responsive. GetInfo says when they ran (``busy_s``, also the counter
``rlmesh_reference_busy_seconds_total``, and ``busy_intervals`` in wall-clock seconds). A model that does not load stops the service at start (exit 2), except
when the path does not exist and the config uses no reference (no KL in reward or loss): then it
starts without one and answers LogProbs with FAILED_PRECONDITION.

Service settings: config keys under ``rlmesh.reference`` (``model_path``, ``max_tokens``,
``max_batch_size``, ``device``, ``dtype``), each overridden by a flag (before or after the
overrides) or, failing that, its environment variable:
  --model-path PATH          the reference model instead of actor_rollout_ref.model.path [RLMESH_REFERENCE_MODEL_PATH]
  --max-tokens N             token budget per forward [RLMESH_REFERENCE_MAX_TOKENS]
  --max-batch-size N         larger batches get INVALID_ARGUMENT (default 1024) [RLMESH_REFERENCE_MAX_BATCH_SIZE]
  --device DEVICE            cpu, cuda, cuda:1 ... (default: cuda when available) [RLMESH_REFERENCE_DEVICE]
  --dtype DTYPE              float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU) [RLMESH_REFERENCE_DTYPE]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from rlmesh.config import RLMeshConfig
from rlmesh.runtime.busy import BusySecondsCollector, BusyTracker
from rlmesh.runtime.entry import service_main
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import common_pb2, reference_pb2, reference_pb2_grpc

DESCRIPTION = (
    "Reference service: per-token log-probs of responses under the frozen reference policy. Settings: "
    "rlmesh.reference.* keys, overridden by flags (or env RLMESH_REFERENCE_*): --model-path PATH, --max-tokens N, --max-batch-size N, --device D, --dtype T."
)
SERVICE_NAME = reference_pb2.DESCRIPTOR.services_by_name["Reference"].full_name
DTYPES = ("float32", "bfloat16", "float16")

log = logging.getLogger("rlmesh.reference")


class ReferenceMetrics:
    def __init__(self, registry: Any, busy: BusyTracker) -> None:
        self.samples = Counter("rlmesh_reference_samples", "samples answered", registry=registry)
        self.tokens = Counter(
            "rlmesh_reference_tokens", "prompt + response tokens of samples answered", registry=registry
        )
        self.padded_tokens = Counter(
            "rlmesh_reference_padded_tokens", "tokens forwarded, padding included", registry=registry
        )
        self.micro_batches = Counter("rlmesh_reference_micro_batches", "forward passes", registry=registry)
        self.compute_seconds = Histogram(
            "rlmesh_reference_compute_seconds",
            "time to compute one call's log-probs",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )
        # Calls overlap (they queue for the model), so the histogram's sum is no busy time: this is.
        registry.register(
            BusySecondsCollector(
                busy, "rlmesh_reference_busy_seconds", "wall seconds with at least one forward running"
            )
        )


class ReferenceServicer(reference_pb2_grpc.ReferenceServicer):
    def __init__(
        self,
        model: Any,
        *,
        model_path: str,
        max_concurrency: int,
        timeout_s: float,
        max_tokens: int,
        max_batch_size: int,
        metrics: ReferenceMetrics,
        busy: BusyTracker,
        missing_reason: str = "",
    ) -> None:
        self.model = model  # a ReferenceModel, or None when the service runs without one
        self.busy = busy  # the model's forwards (``model.busy``)
        self.model_path = model_path
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.max_batch_size = max_batch_size
        self.metrics = metrics
        self.missing_reason = missing_reason
        self._semaphore = asyncio.Semaphore(max_concurrency)

    async def LogProbs(
        self, request: reference_pb2.LogProbsRequest, context: grpc.aio.ServicerContext
    ) -> reference_pb2.LogProbsResponse:
        from rlmesh.reference.compute import Cancelled, InvalidRequestError

        samples = request.samples
        if self.model is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.missing_reason)
        try:
            self.model.validate(samples)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        remaining = context.time_remaining()
        budget = self.timeout_s if remaining is None else min(self.timeout_s, remaining)
        deadline = time.monotonic() + budget
        stop = False

        def should_stop() -> bool:
            return stop or time.monotonic() > deadline

        def on_micro_batch(rows: int, padded: int) -> None:
            self.metrics.micro_batches.inc()
            self.metrics.padded_tokens.inc(padded)

        async with self._semaphore:
            started = time.perf_counter()
            try:
                log_probs = await asyncio.to_thread(
                    self.model.log_probs, samples, should_stop=should_stop, on_micro_batch=on_micro_batch
                )
            except Cancelled:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"log-probs of {len(samples)} samples took over {budget:.3g} s",
                )
            except asyncio.CancelledError:
                stop = True  # the caller went away: the worker thread stops at the next micro-batch
                raise
            self.metrics.compute_seconds.observe(time.perf_counter() - started)
        self.metrics.samples.inc(len(samples))
        self.metrics.tokens.inc(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples))
        return reference_pb2.LogProbsResponse(
            results=[
                reference_pb2.LogProbsResult(uid=s.uid, log_probs=lp)
                for s, lp in zip(samples, log_probs, strict=True)
            ]
        )

    async def GetInfo(
        self, request: common_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> reference_pb2.ReferenceInfo:
        model = self.model
        return reference_pb2.ReferenceInfo(
            model_path=self.model_path,
            dtype=model.dtype_name if model is not None else "",
            vocab_size=model.vocab_size if model is not None else 0,
            max_tokens_per_batch=self.max_tokens,
            max_batch_size=self.max_batch_size,
            busy_s=self.busy.busy_s,
            busy_intervals=[t for interval in self.busy.intervals() for t in interval],
        )


def option_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    env = os.environ.get
    parser.add_argument("--model-path", default=env("RLMESH_REFERENCE_MODEL_PATH") or None)
    parser.add_argument("--max-tokens", type=int, default=_int(env("RLMESH_REFERENCE_MAX_TOKENS")))
    parser.add_argument("--max-batch-size", type=int, default=_int(env("RLMESH_REFERENCE_MAX_BATCH_SIZE")))
    parser.add_argument("--device", default=env("RLMESH_REFERENCE_DEVICE") or None)
    parser.add_argument("--dtype", choices=DTYPES, default=env("RLMESH_REFERENCE_DTYPE") or None)
    return parser


def _int(value: str | None) -> int | None:
    return int(value) if value else None


def _settled(options: argparse.Namespace, cfg: RLMeshConfig) -> argparse.Namespace:
    """The service's settings: each flag (or its env var), else its ``rlmesh.reference`` key."""
    section = cfg.rlmesh.reference
    return argparse.Namespace(
        model_path=options.model_path or section.model_path,
        max_tokens=options.max_tokens or section.max_tokens,
        max_batch_size=options.max_batch_size or section.max_batch_size,
        device=options.device or section.device,
        dtype=options.dtype or section.dtype,
    )


def _load(cfg: RLMeshConfig, options: argparse.Namespace, path: str, max_tokens: int) -> Any:
    import torch

    from rlmesh.reference.compute import ReferenceModel

    temperature = cfg.actor_rollout_ref.rollout.temperature
    if temperature <= 0:
        log.warning("rollout.temperature is %s (greedy): reference log-probs use temperature 1", temperature)
        temperature = 1.0
    model_cfg = cfg.actor_rollout_ref.model
    return ReferenceModel.load(
        path,
        device=options.device,
        dtype=getattr(torch, options.dtype) if options.dtype else None,
        trust_remote_code=model_cfg.trust_remote_code,
        override_config=model_cfg.override_config or None,
        max_tokens_per_batch=max_tokens,
        max_samples_per_batch=cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
        max_batch_size=options.max_batch_size,
        temperature=temperature,
    )


def make_build(flags: argparse.Namespace):  # type: ignore[no-untyped-def]
    async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
        options = _settled(flags, cfg)
        path = options.model_path or cfg.actor_rollout_ref.model.path
        max_tokens = options.max_tokens or cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu
        model, missing = None, ""
        needed = cfg.uses_reference()
        # A path that is not a local directory may still be a hub id in the local HF cache: try it
        # when the run needs the reference; otherwise start without a model.
        if Path(path).expanduser().exists() or options.model_path or needed:
            try:
                model = await asyncio.to_thread(_load, cfg, options, path, max_tokens)
            except Exception as e:
                why = (
                    " (this config needs the reference: algorithm.use_kl_in_reward or "
                    "actor_rollout_ref.actor.use_kl_loss is true)"
                    if needed
                    else ""
                )
                msg = f"cannot load the reference model at {path!r}{why}: {type(e).__name__}: {e}"
                log.error("cannot start: %s", msg)
                print(f"rlmesh reference: {msg}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
            log.info(
                "reference model ready",
                extra={
                    "model_path": path,
                    "dtype": model.dtype_name,
                    "device": str(model.device),
                    "vocab_size": model.vocab_size,
                    "max_tokens_per_batch": max_tokens,
                },
            )
        else:
            missing = (
                f"no reference model loaded: actor_rollout_ref.model.path={path!r} does not exist (this config "
                "uses no KL to the reference, so the service started without one)"
            )
            log.warning(missing)
        busy = model.busy if model is not None else BusyTracker()
        servicer = ReferenceServicer(
            model,
            model_path=path,
            max_concurrency=cfg.rlmesh.reference.max_concurrency,
            timeout_s=cfg.rlmesh.reference.timeout_s,
            max_tokens=max_tokens,
            max_batch_size=options.max_batch_size,
            metrics=ReferenceMetrics(service.registry, busy),
            busy=busy,
            missing_reason=missing,
        )
        service.add_servicer(reference_pb2_grpc.add_ReferenceServicer_to_server, servicer, SERVICE_NAME)

    return build


def main(argv: Sequence[str] | None = None) -> int:
    options, rest = option_parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    return service_main("reference", make_build(options), rest, description=DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main())
