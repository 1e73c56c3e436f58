"""``ReferenceClient``: how rollout replicas call the reference service.

docs/internals.md#rlmeshreferenceclient"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlmesh.runtime.address_sources import AddressSource, StaticAddresses
from rlmesh.runtime.balancer import BalancedCaller
from rlmesh.v1 import common_pb2, reference_pb2, reference_pb2_grpc

if TYPE_CHECKING:
    from rlmesh.config import RLMeshConfig


class ReferenceClient:
    def __init__(
        self,
        addresses: AddressSource | Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        max_attempts: int = 3,
        backoff_s: float = 0.05,
    ) -> None:
        self._caller = BalancedCaller(
            "reference",
            reference_pb2_grpc.ReferenceStub,
            addresses,
            token=token,
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            backoff_s=backoff_s,
        )

    @classmethod
    def from_config(cls, cfg: RLMeshConfig, **kwargs: Any) -> ReferenceClient:
        section = cfg.rlmesh.reference
        kwargs.setdefault("token", cfg.rlmesh.token())
        kwargs.setdefault("timeout_s", section.timeout_s)
        return cls(StaticAddresses(section.client_addresses()), **kwargs)

    async def log_probs(
        self, samples: Sequence[reference_pb2.LogProbsSample], *, timeout_s: float | None = None
    ) -> list[reference_pb2.LogProbsResult]:
        """One result per sample, in order. Raises ``ServiceCallError`` when the call fails."""
        request = reference_pb2.LogProbsRequest(samples=list(samples))
        reply = await self._caller.call("LogProbs", request, timeout_s=timeout_s)
        return list(reply.results)

    async def log_probs_of(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """Plain lists in, plain lists out (uids are the sample positions)."""
        samples = [
            reference_pb2.LogProbsSample(uid=str(i), prompt_ids=p, response_ids=r)
            for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
        ]
        return [list(r.log_probs) for r in await self.log_probs(samples)]

    async def info(self) -> reference_pb2.ReferenceInfo:
        return await self._caller.call("GetInfo", common_pb2.Empty())

    async def close(self) -> None:
        await self._caller.close()

    async def __aenter__(self) -> ReferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
