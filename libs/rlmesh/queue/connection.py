"""An asyncio Redis client that rides out connection loss and Redis restarts.

docs/reliability.md#redis-connection"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError, ConnectionError, TimeoutError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from rlmesh.config.redis_url import redis_url_problem

log = logging.getLogger("rlmesh.queue")

T = TypeVar("T")
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (ConnectionError, TimeoutError, BusyLoadingError, OSError)
# What Redis answers a client that sends no password to a server that wants one (RESP2, RESP3).
_NO_PASSWORD_SENT = ("NOAUTH", "Authentication required", "HELLO must be called with the client already")


class RedisAccessError(RuntimeError):
    """Redis refused this client for good: no password, a wrong user or password, a TLS peer that
    does not verify, a TLS file that cannot be read. Retrying cannot help."""


def access_refusal(error: BaseException) -> str | None:
    """Why ``error`` is a refusal no retry gets past (saying what to fix), or None when it may pass.

    redis-py raises AuthenticationError, and TLS failures, as ConnectionError, which is what a Redis
    restart raises too: without this they would be retried for minutes."""
    if isinstance(error, AuthenticationError):
        if any(s in str(error) for s in _NO_PASSWORD_SENT):
            return (
                "Redis needs a password and rlmesh.redis_url gives none "
                "(redis://:PASSWORD@host:port/db, or redis://USER:PASSWORD@… for an ACL user)"
            )
        return f"Redis refused rlmesh.redis_url's user and password: {error}"
    if isinstance(error, ConnectionError):
        cause = error.__cause__ or error.__context__
        if isinstance(cause, ssl.SSLError):
            return (
                f"TLS with Redis failed: {error} (rediss:// takes ssl_ca_certs=CA file, and "
                "ssl_certfile/ssl_keyfile where the server checks clients, as query parameters)"
            )
        if isinstance(cause, (FileNotFoundError, PermissionError, IsADirectoryError)):
            return f"a TLS file named in rlmesh.redis_url cannot be read: {error}"
    return None


class _TransientRetry(Retry):
    """redis-py's retry, less the refusals (``access_refusal``)."""

    async def call_with_retry(  # type: ignore[override]
        self,
        do: Callable[[], Awaitable[T]],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def retryable(error: Exception) -> bool:
            return access_refusal(error) is None and (is_retryable is None or is_retryable(error))

        return await super().call_with_retry(do, fail, retryable, with_failure_count)


def connect(url: str, *, retries: int = 10, socket_timeout_s: float | None = 30.0) -> aioredis.Redis:
    """A client for ``url`` with bytes replies (protobuf payloads) and backoff retries. ``url``:
    redis:// or rediss:// (TLS; its files as query parameters: ssl_ca_certs, ssl_certfile,
    ssl_keyfile), with ``user:password@`` or ``:password@``; ValueError, its password masked,
    when it is not one."""
    problem = redis_url_problem(url, check_files=True)
    if problem:
        raise ValueError(f"rlmesh.redis_url={problem}")
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        retry=_TransientRetry(ExponentialBackoff(cap=1.0, base=0.02), retries),
        retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError],
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=5.0,
        health_check_interval=15,
    )


async def retry_redis_with_deadline(
    op: Callable[[], Awaitable[T]], what: str, deadline_s: float = 300.0
) -> T:
    """Runs ``op``, retrying transient Redis errors with a doubling backoff (0.05 s up to 2 s) until
    ``deadline_s`` has passed since the first try: then ConnectionError. A refusal no retry gets
    past (``access_refusal``) raises RedisAccessError at once."""

    async def attempt() -> T:
        try:
            return await op()
        except TRANSIENT_ERRORS as e:
            refusal = access_refusal(e)
            if refusal:
                raise RedisAccessError(f"{what}: {refusal}") from e
            raise

    def log_retry(state: RetryCallState) -> None:
        assert state.outcome is not None and state.next_action is not None
        error = state.outcome.exception()
        log.warning("%s: Redis unavailable (%s); retrying in %.2f s", what, error, state.next_action.sleep)

    def give_up(state: RetryCallState) -> NoReturn:
        assert state.outcome is not None
        error = state.outcome.exception()
        waited = state.seconds_since_start or 0.0
        raise ConnectionError(f"{what}: Redis unreachable for {waited:.0f} s: {error}") from error

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(TRANSIENT_ERRORS),
        wait=wait_exponential(multiplier=0.05, max=2.0),
        stop=stop_after_delay(deadline_s),
        before_sleep=log_retry,
        retry_error_callback=give_up,
    )
    return await retrying(attempt)
