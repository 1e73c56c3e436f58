"""An asyncio Redis client that rides out connection loss and Redis restarts.

docs/reliability.md#redis-connection"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

log = logging.getLogger("rlmesh.queue")

T = TypeVar("T")
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (ConnectionError, TimeoutError, BusyLoadingError, OSError)


def connect(url: str, *, retries: int = 10, socket_timeout_s: float | None = 30.0) -> aioredis.Redis:
    """A client for ``url`` with bytes replies (protobuf payloads) and backoff retries."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.02), retries),
        retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError],
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=5.0,
        health_check_interval=15,
    )


async def retry_forever(op: Callable[[], Awaitable[T]], what: str, deadline_s: float = 300.0) -> T:
    """Runs ``op`` until it succeeds, backing off on transient Redis errors, up to ``deadline_s``."""
    start = time.monotonic()
    delay = 0.05
    while True:
        try:
            return await op()
        except TRANSIENT_ERRORS as e:
            waited = time.monotonic() - start
            if waited > deadline_s:
                raise ConnectionError(f"{what}: Redis unreachable for {waited:.0f} s: {e}") from e
            log.warning("%s: Redis unavailable (%s); retrying in %.2f s", what, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
