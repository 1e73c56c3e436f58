"""Retries with backoff and a circuit breaker for calls to reward and reference services.

docs/reliability.md#calls-between-services"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

log = logging.getLogger("rlmesh.rollout")

T = TypeVar("T")


class CircuitBreaker:
    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, name: str, failures: int = 5, reset_s: float = 5.0) -> None:
        self.name = name
        self.threshold = failures
        self.reset_s = reset_s
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self._trial = asyncio.Lock()

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return self.CLOSED
        return self.HALF_OPEN if time.monotonic() - self.opened_at >= self.reset_s else self.OPEN

    def wait_s(self) -> float:
        """Seconds until a call may be tried (0 when closed or half-open)."""
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.reset_s - (time.monotonic() - self.opened_at))

    def record_success(self) -> None:
        if self.opened_at is not None:
            log.info("%s: breaker closed again", self.name)
        self.consecutive_failures = 0
        self.opened_at = None

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.threshold:
            if self.opened_at is None:
                log.error(
                    "%s: breaker open after %d consecutive failures", self.name, self.consecutive_failures
                )
            self.opened_at = time.monotonic()


TRANSIENT_GRPC_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)


def is_transient(e: BaseException) -> bool:
    """Errors worth retrying: a dependency unreachable, overloaded or failing on its side. A
    request the other side refused as malformed (4xx, INVALID_ARGUMENT, ...) is not."""
    from rlmesh.engine.client import EngineError

    if isinstance(e, EngineError):
        return not e.rejected
    code = getattr(e, "code", None)  # grpc.RpcError has code(); rlmesh's ServiceCallError has .code
    code = code() if callable(code) else code
    if isinstance(code, grpc.StatusCode):
        return code in TRANSIENT_GRPC_CODES
    return isinstance(e, ConnectionError | TimeoutError | OSError)


class Stopped(Exception):
    """The caller asked to stop while a call was still being retried."""


async def call_until_ok(
    fn: Callable[[], Awaitable[T]],
    *,
    breaker: CircuitBreaker,
    retryable: Callable[[BaseException], bool],
    stop: asyncio.Event,
    backoff_s: float = 0.2,
    max_backoff_s: float = 10.0,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Calls ``fn`` until it returns; errors ``retryable`` accepts back off (doubling, capped), others raise.
    While the breaker is open, waits for it; only one trial call passes when it half-opens."""

    async def attempt() -> T:
        while True:
            if stop.is_set():
                raise Stopped(f"{breaker.name}: stopped while retrying")
            wait = breaker.wait_s()
            if wait > 0:  # waiting out an open breaker is not an attempt: the backoff stays
                await _sleep_or_stop(wait, stop)
                continue
            if breaker.state != CircuitBreaker.HALF_OPEN:
                return await fn()
            async with breaker._trial:
                if breaker.state != CircuitBreaker.OPEN:  # OPEN: the trial ahead of this one failed
                    return await fn()

    def worth_retrying(e: BaseException) -> bool:
        return isinstance(e, Exception) and not isinstance(e, Stopped) and retryable(e)

    def record_failure(state: RetryCallState) -> None:
        assert state.outcome is not None and state.next_action is not None
        e = state.outcome.exception()
        assert e is not None
        breaker.record_failure()
        if on_retry:
            on_retry(e)
        log.warning("%s failed (%s); retrying in %.2f s", breaker.name, e, state.next_action.sleep)

    retrying = AsyncRetrying(
        retry=retry_if_exception(worth_retrying),
        wait=wait_exponential(multiplier=backoff_s, max=max_backoff_s),
        sleep=lambda seconds: _sleep_or_stop(seconds, stop),
        before_sleep=record_failure,
    )
    result = await retrying(attempt)
    breaker.record_success()
    return result


async def _sleep_or_stop(seconds: float, stop: asyncio.Event) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return
