"""gRPC ``rlmesh.v1.Rollout`` for one replica: direct generation, info, pause/resume and drain.
Weight sync goes to the engine's own HTTP API (see protos/rlmesh/v1/rollout.proto)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable

import grpc

from rlmesh.engine.client import EngineClient, EngineError
from rlmesh.rollout.sampler import SamplerLoop, parse_version, sampling_dict
from rlmesh.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger("rlmesh.rollout")

_ENGINE_PROMPT = re.compile(r"input_ids\[(\d+)\](?:\[(\d+)\])?")


def as_generate_request_fields(message: str) -> str:
    """An engine's refusal in the words of ``GenerateRequest``: its ``input_ids[i][j]`` is
    ``inputs[i].prompt_ids[j]`` (``sampling_params`` fields have the same names in both)."""

    def field(m: re.Match[str]) -> str:
        return f"inputs[{m[1]}].prompt_ids" + (f"[{m[2]}]" if m[2] is not None else "")

    return _ENGINE_PROMPT.sub(field, message)


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(
        self,
        *,
        replica_id: str,
        engine_kind: str,
        engine: EngineClient,
        sampler: SamplerLoop,
        capacity: int,
        sampling_defaults: dict,
        on_drained: Callable[[], Awaitable[None]],
    ) -> None:
        self.replica_id = replica_id
        self.engine_kind = engine_kind
        self.engine = engine
        self.sampler = sampler
        self.capacity = capacity
        self.sampling_defaults = sampling_defaults
        self.on_drained = on_drained
        self.state = "serving"

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        if not request.inputs:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "GenerateRequest.inputs is empty")
        for i, item in enumerate(request.inputs):
            if not item.prompt_ids:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"GenerateRequest.inputs[{i}].prompt_ids is empty"
                )
        try:
            params = sampling_dict(request.sampling_params, self.sampling_defaults)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"GenerateRequest.{e}")
        n = request.sampling_params.n if request.sampling_params.HasField("n") else 1
        params["n"] = n
        try:
            out = await self.engine.generate(
                [list(i.prompt_ids) for i in request.inputs], params, return_logprob=request.return_logprob
            )
        except EngineError as e:
            if e.rejected:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"GenerateRequest: {as_generate_request_fields(str(e))}"
                )
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        outputs = []
        for k, o in enumerate(out):
            meta = o["meta_info"]
            outputs.append(
                rollout_pb2.GenerateOutput(
                    uid=request.inputs[k // n].uid,
                    sample_index=k % n,
                    output_ids=o["output_ids"],
                    output_log_probs=[lp for lp, _, _ in meta.get("output_token_logprobs", [])],
                    finish_reason=str(meta["finish_reason"].get("type", "")),
                    policy_version=parse_version(meta.get("weight_version")),
                )
            )
        return rollout_pb2.GenerateResponse(outputs=outputs)

    async def GetInfo(
        self, request: common_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.RolloutInfo:
        return rollout_pb2.RolloutInfo(
            replica_id=self.replica_id,
            engine=self.engine_kind,
            engine_url=self.engine.url,
            policy_version=self.sampler.policy_version,
            state=self.current_state(),
            running_requests=self.sampler.in_flight,
            capacity=self.capacity,
            tokens_per_s=self.sampler.tokens_per_s(),
            tasks_done=self.sampler.tasks_done,
        )

    def current_state(self) -> str:
        if self.state == "serving" and self.sampler.paused:
            return "paused"
        return self.state

    async def Pause(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        # Answers only once the sampler has no claim in progress: nothing is claimed after this.
        await self.sampler.pause()
        return common_pb2.Ack(
            success=True,
            message=f"stopped claiming tasks; {self.sampler.in_flight} in-flight task(s) finish",
        )

    async def Resume(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext) -> common_pb2.Ack:
        if self.state == "draining":
            return common_pb2.Ack(success=False, message="replica is draining")
        self.sampler.resume()
        return common_pb2.Ack(success=True, message="claiming tasks")

    async def Drain(
        self, request: rollout_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.DrainResponse:
        self.state = "draining"
        t0 = time.monotonic()
        unfinished = await self.sampler.drain(request.timeout_s or 60.0)
        await self.on_drained()
        msg = f"drained in {time.monotonic() - t0:.1f} s; {unfinished} task(s) left for other replicas"
        log.info(msg)
        return rollout_pb2.DrainResponse(drained=unfinished == 0, unfinished=unfinished, message=msg)
