"""A gRPC caller over replicas: round-robin, a deadline per attempt, retries against the next
address, the bearer token on every call. docs/reliability.md#calls-between-services"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from rlmesh.runtime.addresses import AddressSource, StaticAddresses
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
        delay = self.backoff_s
        last: grpc.aio.AioRpcError | None = None
        for attempt in range(self.max_attempts):
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
            try:
                return await getattr(self._stub(address), method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                last = e
                if e.code() not in RETRYABLE or attempt == self.max_attempts - 1:
                    break
                log.warning(
                    "%s.%s at %s failed with %s (%s); retrying on the next address in %.2f s",
                    self.service,
                    method,
                    address,
                    e.code().name,
                    e.details(),
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
        assert last is not None
        raise ServiceCallError(self.service, method, last.code(), last.details() or "", tried) from last

    async def close(self) -> None:
        stubs, self._stubs = self._stubs, {}
        for channel, _ in stubs.values():
            with contextlib.suppress(Exception):
                await channel.close()
        for task in list(self._closing):
            task.cancel()
