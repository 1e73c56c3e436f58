"""A gRPC caller over replicas: round-robin, a deadline per attempt, retries against the next
address, the bearer token on every call. docs/reliability.md#calls-between-services"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential

from rlmesh.runtime.address_sources import AddressSource, StaticAddresses
from rlmesh.runtime.auth import client_auth_interceptors
from rlmesh.runtime.server import CLIENT_GRPC_OPTIONS
from rlmesh.runtime.tls import aio_channel

log = logging.getLogger("rlmesh.client")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class ServiceCallError(RuntimeError):
    """A call failed for good; ``code`` is the last gRPC status, the message names the addresses tried."""

    def __init__(self, service: str, method: str, code: grpc.StatusCode, details: str, tried: Sequence[str]):
        self.service = service
        self.method = method
        self.code = code
        self.details = details
        self.tried = list(tried)
        where = f" (tried {', '.join(tried)})" if tried else ""
        super().__init__(f"{service}.{method}: {code.name}: {details}{where}")


class BalancedCaller:
    def __init__(
        self,
        service: str,
        stub_class: Callable[[grpc.aio.Channel], Any],
        source: AddressSource | Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        max_attempts: int = 3,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
    ) -> None:
        if max_attempts < 1 or timeout_s <= 0:
            raise ValueError("max_attempts must be >= 1 and timeout_s > 0")
        self.service = service
        self.stub_class = stub_class
        self.source: AddressSource = (
            StaticAddresses(source) if isinstance(source, list | tuple) else source  # type: ignore[arg-type]
        )
        self.token = token
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._stubs: dict[str, tuple[grpc.aio.Channel, Any]] = {}
        self._next = 0
        self._closing: set[asyncio.Task[None]] = set()

    def _stub(self, address: str) -> Any:
        entry = self._stubs.get(address)
        if entry is None:
            channel = aio_channel(
                address,
                options=CLIENT_GRPC_OPTIONS,
                interceptors=client_auth_interceptors(self.token) or None,
            )
            entry = (channel, self.stub_class(channel))
            self._stubs[address] = entry
        return entry[1]

    def _forget_others(self, current: Sequence[str]) -> None:
        """Closes channels to addresses no longer listed (after a grace, so in-flight calls finish)."""
        for address in [a for a in self._stubs if a not in current]:
            channel, _ = self._stubs.pop(address)
            task = asyncio.ensure_future(channel.close(grace=self.timeout_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def call(self, method: str, request: Any, *, timeout_s: float | None = None) -> Any:
        """``method`` of the service on the next address; see the module docstring."""
        timeout = timeout_s or self.timeout_s
        tried: list[str] = []

        async def attempt() -> Any:
            addresses = await self.source.addresses()
            if not addresses:
                raise ServiceCallError(
                    self.service,
                    method,
                    grpc.StatusCode.UNAVAILABLE,
                    f"no addresses from {self.source!r}",
                    tried,
                )
            self._forget_others(addresses)
            address = addresses[self._next % len(addresses)]
            self._next += 1
            tried.append(address)
            return await getattr(self._stub(address), method)(request, timeout=timeout)

        def log_retry(state: RetryCallState) -> None:
            assert state.outcome is not None and state.next_action is not None
            e = state.outcome.exception()
            assert isinstance(e, grpc.aio.AioRpcError)
            log.warning(
                "%s.%s at %s failed with %s (%s); retrying on the next address in %.2f s",
                self.service,
                method,
                tried[-1],
                e.code().name,
                e.details(),
                state.next_action.sleep,
            )

        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda e: isinstance(e, grpc.aio.AioRpcError) and e.code() in RETRYABLE),
            wait=wait_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
            stop=stop_after_attempt(self.max_attempts),
            before_sleep=log_retry,
            reraise=True,
        )
        try:
            return await retrying(attempt)
        except grpc.aio.AioRpcError as e:
            raise ServiceCallError(self.service, method, e.code(), e.details() or "", tried) from e

    async def close(self) -> None:
        stubs, self._stubs = self._stubs, {}
        for channel, _ in stubs.values():
            with contextlib.suppress(Exception):
                await channel.close()
        for task in list(self._closing):
            task.cancel()
