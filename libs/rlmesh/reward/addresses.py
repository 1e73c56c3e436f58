"""The run's reward address list in Redis (one JSON array of ``host:port``, signed with the run's
keys): a swap is one atomic SET every replica's reward client follows within ``cache_s``; a list the
signer does not vouch for reads as none. docs/security.md#redis-entries"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rlmesh.config.address_checks import check_peer_address
from rlmesh.queue.keys import RunKeys
from rlmesh.queue.signing import INVALID, UNDECODABLE, UNTRUSTED, Signer, unwrap, wrap
from rlmesh.runtime.address_sources import RedisAddresses, get_addresses, set_addresses

REWARD_ADDRESSES = "reward_addresses"
WHAT = "reward_addresses"


def _keys(run: str | RunKeys) -> RunKeys:
    return run if isinstance(run, RunKeys) else RunKeys(run)


def reward_addresses_key(run: str | RunKeys) -> str:
    return _keys(run).scoped(REWARD_ADDRESSES)


class _TrustedReads:
    """The one read ``RedisAddresses`` makes (``get``), answering None for a list the signer does
    not vouch for, or that names something other than a service: as if none were set."""

    def __init__(self, redis: Any, signer: Signer | None) -> None:
        self.redis = redis
        self.signer = signer

    async def get(self, key: str) -> bytes | None:
        value = await self.redis.get(key)
        if value is None:
            return None
        payload = unwrap(self.signer, key, value, WHAT)
        if payload is None:
            return None
        try:
            listed = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as e:
            UNTRUSTED.count(WHAT, UNDECODABLE, f"{key} is not a JSON list: {e}")
            return None
        try:
            if not isinstance(listed, list):
                raise ValueError("not a JSON array")
            for address in listed:
                check_peer_address(address)
        except ValueError as e:
            UNTRUSTED.count(WHAT, INVALID, f"{key}: {e}")
            return None
        return payload


def reward_address_source(
    redis: Any, run: str | RunKeys, *, fallback: Sequence[str] = (), cache_s: float = 0.5
) -> RedisAddresses:
    """The addresses a reward client calls: the run's list in Redis, else ``fallback``. ``run``:
    the run's keys (their signer checks the list) or its id (no check: a run without a token)."""
    keys = _keys(run)
    reads = _TrustedReads(redis, keys.signer)
    return RedisAddresses(reads, reward_addresses_key(keys), fallback=fallback, cache_s=cache_s)


async def set_reward_addresses(redis: Any, run: str | RunKeys, addresses: Sequence[str]) -> list[str]:
    """Points every reward client of the run at ``addresses`` (they follow within ``cache_s``);
    signed with the signer of ``run`` when it has one."""
    keys = _keys(run)
    checked = [check_peer_address(a) for a in addresses]
    if keys.signer is None or not checked:
        return await set_addresses(redis, reward_addresses_key(keys), checked)
    key = reward_addresses_key(keys)
    await redis.set(key, wrap(keys.signer, key, json.dumps(checked).encode()))
    return checked


async def get_reward_addresses(redis: Any, run: str | RunKeys) -> list[str] | None:
    """The run's reward address list in Redis, or None when none is set (or none to trust)."""
    keys = _keys(run)
    return await get_addresses(_TrustedReads(redis, keys.signer), reward_addresses_key(keys))
