"""``RewardClient``: how rollout replicas (and anyone else) call the reward service.

docs/internals.md#rlmeshrewardclient"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlmesh.queue.keys import RunKeys
from rlmesh.reward.addresses import reward_address_source
from rlmesh.runtime.address_sources import AddressSource, StaticAddresses
from rlmesh.runtime.balancer import BalancedCaller
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

if TYPE_CHECKING:
    from rlmesh.config import RLMeshConfig


class RewardClient:
    def __init__(
        self,
        addresses: AddressSource | Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        max_attempts: int = 3,
        backoff_s: float = 0.05,
        max_batch_size: int | None = None,
    ) -> None:
        """``max_batch_size``: split larger batches into calls of at most this many samples (sent
        concurrently, so replicas share them); None sends each batch whole."""
        self.max_batch_size = max_batch_size
        self._caller = BalancedCaller(
            "reward",
            reward_pb2_grpc.RewardStub,
            addresses,
            token=token,
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            backoff_s=backoff_s,
        )

    @classmethod
    def from_config(cls, cfg: RLMeshConfig, redis: Any = None, **kwargs: Any) -> RewardClient:
        """Addresses from Redis (when ``redis`` is given and the run has an id) over the configured ones;
        token and deadline from the config."""
        section = cfg.rlmesh.reward
        fallback = section.client_addresses()
        source: AddressSource
        if redis is not None and cfg.rlmesh.run_id:
            keys = RunKeys.signed(cfg.rlmesh.run_id, cfg.rlmesh.token())
            source = reward_address_source(redis, keys, fallback=fallback)
        else:
            source = StaticAddresses(fallback)
        kwargs.setdefault("token", cfg.rlmesh.token())
        kwargs.setdefault("timeout_s", section.timeout_s)
        return cls(source, **kwargs)

    @property
    def source(self) -> AddressSource:
        return self._caller.source

    async def score(
        self, samples: Sequence[reward_pb2.RewardSample], *, timeout_s: float | None = None
    ) -> list[reward_pb2.RewardResult]:
        """One result per sample, in order; per-sample failures are in ``result.error``. Raises
        ``ServiceCallError`` when the call fails (INVALID_ARGUMENT, or no replica answered)."""
        samples = list(samples)
        size = self.max_batch_size
        if size is None or len(samples) <= size:
            reply = await self._caller.call(
                "Score", reward_pb2.ScoreRequest(samples=samples), timeout_s=timeout_s
            )
            return list(reply.results)
        chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
        replies = await asyncio.gather(
            *(
                self._caller.call("Score", reward_pb2.ScoreRequest(samples=c), timeout_s=timeout_s)
                for c in chunks
            )
        )
        return [r for reply in replies for r in reply.results]

    async def info(self) -> reward_pb2.RewardInfo:
        return await self._caller.call("GetInfo", common_pb2.Empty())

    async def close(self) -> None:
        await self._caller.close()

    async def __aenter__(self) -> RewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
