"""Where clients find a service: a fixed list, or a JSON list at a Redis key read at each call
(cached ``cache_s``; the last list read, else the fallback, while the key is unset or Redis is
down). docs/reliability.md describes swapping a service through it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from rlmesh.config.address_checks import check_address

log = logging.getLogger("rlmesh.client")


class AddressSource(Protocol):
    async def addresses(self) -> list[str]: ...


class StaticAddresses:
    """A fixed list (e.g. ``cfg.rlmesh.reference.client_addresses()``)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = [check_address(a) for a in addresses]
        if not self._addresses:
            raise ValueError("no addresses given")

    async def addresses(self) -> list[str]:
        return list(self._addresses)

    def __repr__(self) -> str:
        return f"StaticAddresses({self._addresses})"


class RedisAddresses:
    """The list stored at ``key`` (a JSON array), cached for ``cache_s`` seconds."""

    def __init__(self, redis: Any, key: str, *, fallback: Sequence[str] = (), cache_s: float = 0.5) -> None:
        self.redis = redis
        self.key = key
        self.fallback = [check_address(a) for a in fallback]
        self.cache_s = cache_s
        self._cached: list[str] | None = None
        self._read_at = float("-inf")

    async def addresses(self) -> list[str]:
        now = time.monotonic()
        if self._cached is not None and now - self._read_at < self.cache_s:
            return list(self._cached)
        try:
            raw = await self.redis.get(self.key)
        except Exception as e:  # Redis down: keep serving what we know
            log.warning("cannot read %s from Redis (%s); using the last known addresses", self.key, e)
            return list(self._cached or self.fallback)
        listed = _parse(raw, self.key)
        if listed is None:
            listed = self._cached if raw is not None and self._cached else self.fallback
        self._cached, self._read_at = list(listed), now
        return list(listed)

    def __repr__(self) -> str:
        return f"RedisAddresses({self.key!r}, fallback={self.fallback})"


def _parse(raw: Any, key: str) -> list[str] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        if not isinstance(value, list):
            raise ValueError("not a JSON array")
        return [check_address(a) for a in value] or None
    except (ValueError, UnicodeDecodeError) as e:
        log.warning("ignoring the address list at %s: %s", key, e)
        return None


async def set_addresses(redis: Any, key: str, addresses: Sequence[str]) -> list[str]:
    """Stores the list at ``key`` (one atomic SET); an empty list deletes it (clients fall back)."""
    checked = [check_address(a) for a in addresses]
    if checked:
        await redis.set(key, json.dumps(checked))
    else:
        await redis.delete(key)
    return checked


async def get_addresses(redis: Any, key: str) -> list[str] | None:
    return _parse(await redis.get(key), key)
