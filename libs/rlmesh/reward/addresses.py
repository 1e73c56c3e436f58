"""The run's reward address list in Redis: ``rlmesh:{<run>}:reward_addresses``, one JSON array of
``host:port``, so a swap is one atomic SET and every replica's reward client follows it within
``cache_s`` without a restart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlmesh.queue.keys import RunKeys
from rlmesh.runtime.addresses import RedisAddresses, get_addresses, set_addresses

REWARD_ADDRESSES = "reward_addresses"


def reward_addresses_key(run_id: str) -> str:
    return RunKeys(run_id).scoped(REWARD_ADDRESSES)


def reward_address_source(
    redis: Any, run_id: str, *, fallback: Sequence[str] = (), cache_s: float = 0.5
) -> RedisAddresses:
    """The addresses a reward client calls: the run's list in Redis, else ``fallback``."""
    return RedisAddresses(redis, reward_addresses_key(run_id), fallback=fallback, cache_s=cache_s)


async def set_reward_addresses(redis: Any, run_id: str, addresses: Sequence[str]) -> list[str]:
    """Points every reward client of the run at ``addresses`` (they follow within ``cache_s``)."""
    return await set_addresses(redis, reward_addresses_key(run_id), addresses)


async def get_reward_addresses(redis: Any, run_id: str) -> list[str] | None:
    """The run's reward address list in Redis, or None when none is set."""
    return await get_addresses(redis, reward_addresses_key(run_id))
