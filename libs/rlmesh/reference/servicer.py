"""The gRPC face of ``ReferenceModel``: ``Reference.LogProbs`` and ``Reference.GetInfo``. Without a
model (see ``load_reference_model``) LogProbs answers FAILED_PRECONDITION."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry

from rlmesh.reference.loading import reference_max_tokens, reference_model_path
from rlmesh.reference.metrics import ReferenceMetrics
from rlmesh.runtime.busy import BusyTracker
from rlmesh.v1 import common_pb2, reference_pb2, reference_pb2_grpc

if TYPE_CHECKING:
    from rlmesh.config import RLMeshConfig

SERVICE_NAME = reference_pb2.DESCRIPTOR.services_by_name["Reference"].full_name

log = logging.getLogger("rlmesh.reference")


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

    @classmethod
    def from_config(cls, cfg: RLMeshConfig, model: Any, registry: CollectorRegistry) -> ReferenceServicer:
        """Serves ``model`` (None: the one of ``cfg`` did not exist) with the ``rlmesh.reference`` keys."""
        path = reference_model_path(cfg)
        missing = ""
        if model is None:
            missing = (
                f"no reference model loaded: actor_rollout_ref.model.path={path!r} does not exist (this config "
                "uses no KL to the reference, so the service started without one)"
            )
            log.warning(missing)
        busy = model.busy if model is not None else BusyTracker()
        section = cfg.rlmesh.reference
        return cls(
            model,
            model_path=path,
            max_concurrency=section.max_concurrency,
            timeout_s=section.timeout_s,
            max_tokens=reference_max_tokens(cfg),
            max_batch_size=section.max_batch_size,
            metrics=ReferenceMetrics(registry, busy),
            busy=busy,
            missing_reason=missing,
        )

    async def LogProbs(
        self, request: reference_pb2.LogProbsRequest, context: grpc.aio.ServicerContext
    ) -> reference_pb2.LogProbsResponse:
        from rlmesh.reference.compute import Cancelled
        from rlmesh.runtime.invalid_request import InvalidRequestError

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
        self.metrics.batch_size.observe(len(samples))
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
