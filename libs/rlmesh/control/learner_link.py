"""The control plane's gRPC client of the learner (``rlmesh.v1.Learner``): status, pause, resume,
checkpoint, stop and hyper-parameters, with the run's token; failures become ``ControlError``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from rlmesh.control.errors import ControlError, from_rpc_error
from rlmesh.runtime.auth import bearer_metadata
from rlmesh.runtime.server import CLIENT_GRPC_OPTIONS
from rlmesh.runtime.tls import aio_channel
from rlmesh.v1 import common_pb2, learner_pb2, learner_pb2_grpc

T = TypeVar("T")

# A checkpoint is taken at the next step boundary: the call waits for the step to end.
CHECKPOINT_TIMEOUT_S = 3600.0


class LearnerLink:
    def __init__(self, address: str, token: str | None, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = bearer_metadata(token)
        self._channel = aio_channel(address, options=CLIENT_GRPC_OPTIONS)
        self._stub = learner_pb2_grpc.LearnerStub(self._channel)

    async def _call(
        self, fn: Callable[..., Awaitable[T]], request: object, timeout_s: float | None = None
    ) -> T:
        try:
            return await fn(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(f"learner at {self.address}", e) from None

    async def status(self) -> learner_pb2.LearnerStatus:
        return await self._call(self._stub.GetStatus, common_pb2.Empty())

    async def pause(self) -> learner_pb2.LearnerStatus:
        return await self._call(self._stub.Pause, common_pb2.Empty())

    async def resume(self) -> learner_pb2.LearnerStatus:
        return await self._call(self._stub.Resume, common_pb2.Empty())

    async def checkpoint(self) -> learner_pb2.SaveCheckpointResponse:
        return await self._call(
            self._stub.SaveCheckpoint, learner_pb2.SaveCheckpointRequest(), CHECKPOINT_TIMEOUT_S
        )

    async def stop(self, checkpoint: bool) -> learner_pb2.LearnerStatus:
        return await self._call(self._stub.Stop, learner_pb2.StopRequest(checkpoint=checkpoint))

    async def update(self, values: dict[str, float]) -> learner_pb2.UpdateHyperparamsResponse:
        """``values`` by the proto's field names."""
        try:
            request = learner_pb2.UpdateHyperparamsRequest(**values)
        except (TypeError, ValueError) as e:  # a field this learner's proto does not have
            raise ControlError(422, f"hyper-parameters: {e}") from None
        return await self._call(self._stub.UpdateHyperparams, request)

    async def close(self) -> None:
        await self._channel.close()
