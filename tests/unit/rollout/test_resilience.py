"""call_until_ok: what it retries, what it raises at once, how a stop ends it, and the breaker it
drives."""

import asyncio

import grpc
import pytest

from rlmesh.rollout.resilience import CircuitBreaker, Stopped, call_until_ok, is_transient


class Flaky:
    """Fails with ``error`` for its first ``failures`` calls, then answers ``answer``."""

    def __init__(self, failures: int, error: Exception, answer: object = "ok") -> None:
        self.failures = failures
        self.error = error
        self.answer = answer
        self.calls = 0

    async def __call__(self) -> object:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.answer


async def test_transient_errors_are_retried_until_the_call_answers_and_the_breaker_closes():
    breaker = CircuitBreaker("reward", failures=2, reset_s=0.01)
    retried: list[BaseException] = []
    fn = Flaky(3, ConnectionRefusedError("reward down"))
    result = await call_until_ok(
        fn,
        breaker=breaker,
        retryable=is_transient,
        stop=asyncio.Event(),
        backoff_s=0.001,
        on_retry=retried.append,
    )
    assert result == "ok" and fn.calls == 4
    assert len(retried) == 3 and all(isinstance(e, ConnectionRefusedError) for e in retried)
    assert breaker.state == CircuitBreaker.CLOSED and breaker.consecutive_failures == 0


async def test_an_error_not_worth_retrying_is_raised_at_once():
    breaker = CircuitBreaker("reward")
    fn = Flaky(1, ValueError("malformed"))
    with pytest.raises(ValueError, match="malformed"):
        await call_until_ok(fn, breaker=breaker, retryable=is_transient, stop=asyncio.Event())
    assert fn.calls == 1 and breaker.consecutive_failures == 0


async def test_the_breaker_opens_after_its_threshold_of_consecutive_failures():
    breaker = CircuitBreaker("reference", failures=2, reset_s=60)
    stop = asyncio.Event()
    seen: list[str] = []

    def on_retry(_e: BaseException) -> None:
        seen.append(breaker.state)
        if len(seen) == 2:
            stop.set()  # the breaker is open now: end the wait for it

    fn = Flaky(10, grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None))
    with pytest.raises(Stopped):
        await call_until_ok(
            fn, breaker=breaker, retryable=is_transient, stop=stop, backoff_s=0.001, on_retry=on_retry
        )
    assert seen == [CircuitBreaker.CLOSED, CircuitBreaker.OPEN] and fn.calls == 2


async def test_a_stop_ends_the_retries_even_when_every_error_is_retryable():
    stop = asyncio.Event()
    fn = Flaky(10, RuntimeError("always"))

    def on_retry(_e: BaseException) -> None:
        stop.set()

    with pytest.raises(Stopped):
        await call_until_ok(
            fn, breaker=CircuitBreaker("engine"), retryable=lambda e: True, stop=stop, on_retry=on_retry
        )
    assert fn.calls == 1
