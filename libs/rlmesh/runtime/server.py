"""The gRPC service runtime every rlmesh service stands on: health, auth, metrics, a graceful
shutdown and, when asked for, server reflection (behind the token like every method but
``Health/Check``). docs/design.md#the-processes"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as grpc_reflection
from prometheus_client import CollectorRegistry

from rlmesh.runtime.auth import BearerTokenInterceptor
from rlmesh.runtime.malformed import RefuseMalformedInterceptor
from rlmesh.runtime.metrics import MetricsHttpServer, MetricsInterceptor, RpcMetrics
from rlmesh.runtime.ready_file import write_ready_file
from rlmesh.runtime.tls import TlsFiles, grpc_server_credentials

log = logging.getLogger("rlmesh.runtime")

# A response may be large (log-probs of a whole batch); requests are batches of token
# ids or texts, far smaller, and a server bounds them (``max_request_bytes``) so that one caller
# cannot make it buffer a gigabyte.
MAX_RESPONSE_BYTES = 1024 * 1024 * 1024
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_CONCURRENT_RPCS = 256
CLIENT_GRPC_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
    ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
)


def server_grpc_options(max_request_bytes: int) -> tuple[tuple[str, int], ...]:
    return (
        ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
        ("grpc.max_receive_message_length", max_request_bytes),
    )


AddServicer = Callable[[Any, grpc.aio.Server], None]
ShutdownHook = Callable[[], Awaitable[None]]
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def method_paths(full_service_name: str) -> list[str]:
    """``/package.Service/Method`` of each method of a service whose generated code is imported."""
    try:
        service = descriptor_pool.Default().FindServiceByName(full_service_name)
    except KeyError:
        raise ValueError(f"no service {full_service_name!r} among the imported protos") from None
    return [f"/{full_service_name}/{m.name}" for m in service.methods]


class HealthServicer(health_async.HealthServicer):
    """grpc_health's servicer with a ``Watch`` that ends once the server stops, after sending
    NOT_SERVING. The stock ``Watch`` never returns, so one watcher would hold every graceful stop
    for the whole grace period; it also writes while holding the lock ``set`` needs, so a watcher
    that stops reading could block ``set_serving``. ``Check`` stays the stock one."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._changed = asyncio.Condition()
        self._stopping = False

    async def set(self, service: str, status: int) -> None:
        await super().set(service, status)
        async with self._changed:
            if not self._stopping:
                self._statuses[service] = status
                self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        async with self._changed:
            self._statuses = dict.fromkeys(self._statuses, health_pb2.HealthCheckResponse.NOT_SERVING)
            self._stopping = True
            self._changed.notify_all()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        """Writes the service's status now and on every change (SERVICE_UNKNOWN for a name never
        set); statuses set in between may be skipped, the last one is always sent."""
        last: int | None = None
        while True:
            async with self._changed:
                await self._changed.wait_for(partial(self._news, request.service, last))
                status, stopping = self._status(request.service), self._stopping
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if stopping:
                return

    def _news(self, service: str, last: int | None) -> bool:
        return self._stopping or self._status(service) != last

    def _status(self, service: str) -> int:
        return self._statuses.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)


class GrpcService:
    """One service process's server. Typical use::

    service = GrpcService("reward", port=50051, metrics_port=9101)
    service.add_servicer(reward_pb2_grpc.add_RewardServicer_to_server, servicer, "rlmesh.v1.Reward")
    await service.serve()   # returns after SIGTERM, once drained

    With ``auth_token`` every call but ``Health/Check`` needs the token; server reflection is served
    only with ``reflection=True`` (``rlmesh.security.grpc_reflection``), behind the token too. With
    ``tls`` it serves TLS only (and checks client certificates when ``tls.verify_clients``).
    """

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: Callable[[int], str] | None = None,
        metrics_host: str | None = None,
        metrics_port: int | None = 0,
        auth_token: str | None = None,
        shutdown_grace_s: float = 30.0,
        ready_file: str | os.PathLike[str] | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_concurrent_rpcs: int | None = DEFAULT_MAX_CONCURRENT_RPCS,
        reflection: bool = False,
        tls: TlsFiles | None = None,
    ) -> None:
        self.name = name
        self.tls = tls
        self.host = host
        self.requested_port = port
        self._advertise = advertise
        self.metrics_host = metrics_host or host
        self.requested_metrics_port = metrics_port
        self.shutdown_grace_s = shutdown_grace_s
        self.ready_file = Path(ready_file) if ready_file else None
        self.reflection = reflection
        self.registry = CollectorRegistry()
        self.rpc_metrics = RpcMetrics(self.registry, name)
        # The metrics' method labels; filled as servicers are added, before the server starts.
        self._methods: set[str] = set(method_paths(HEALTH_SERVICE))
        # Metrics outermost, so refused (unauthenticated) calls are counted too.
        interceptors: list[grpc.aio.ServerInterceptor] = [MetricsInterceptor(self.rpc_metrics, self._methods)]
        if auth_token:
            interceptors.append(BearerTokenInterceptor(auth_token))
        interceptors.append(RefuseMalformedInterceptor())
        # A request over max_request_bytes, or a call past max_concurrent_rpcs, is refused with
        # RESOURCE_EXHAUSTED by gRPC itself, before any handler (or parser) sees it. A call the
        # token check refuses ends at once, so callers without the token cannot hold those slots.
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=server_grpc_options(max_request_bytes),
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = []
        self._shutdown_hooks: list[ShutdownHook] = []
        self._start_hooks: list[ShutdownHook] = []
        self._stop_requested = asyncio.Event()
        self.port: int | None = None
        self.metrics_server: MetricsHttpServer | None = None
        # What the process exits with after a graceful stop; a service whose work failed sets 1.
        self.exit_code = 0

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name}: not started")
        return f"{self.host}:{self.port}"

    @property
    def advertised_address(self) -> str:
        """Where peers are told to reach it (docs/design.md#addresses); the bound address if none."""
        if self.port is None:
            raise RuntimeError(f"{self.name}: not started")
        return self._advertise(self.port) if self._advertise else self.address

    def add_servicer(self, add_fn: AddServicer, servicer: Any, full_service_name: str) -> None:
        """Registers a generated servicer, e.g. ``reward_pb2_grpc.add_RewardServicer_to_server``."""
        self._methods.update(method_paths(full_service_name))
        add_fn(servicer, self.server)
        self._service_names.append(full_service_name)

    def on_start(self, hook: ShutdownHook) -> None:
        """Runs ``hook`` once the server is serving (e.g. to start background loops)."""
        self._start_hooks.append(hook)

    def on_shutdown(self, hook: ShutdownHook) -> None:
        """Runs ``hook`` after in-flight RPCs finished (or the grace period ran out), in reverse order."""
        self._shutdown_hooks.append(hook)

    async def set_serving(self, serving: bool) -> None:
        """Flips health for the server and each service (e.g. while a replica drains)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service_name in ("", *self._service_names):
            await self.health.set(service_name, status)

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def end_with(self, exit_code: int) -> None:
        """Stops serving at once and ends the process with ``exit_code`` (for its supervisor)."""
        await self.set_serving(False)
        self.exit_code = exit_code
        self.request_stop()

    async def start(self) -> None:
        if self.reflection:
            self._enable_reflection()
        bind = f"{self.host}:{self.requested_port}"
        if self.tls is None:
            self.port = self.server.add_insecure_port(bind)
        else:
            self.port = self.server.add_secure_port(bind, grpc_server_credentials(self.tls))
        if self.port == 0:
            raise OSError(f"{self.name}: could not bind gRPC on {self.host}:{self.requested_port}")
        await self.server.start()
        if self.requested_metrics_port is not None:
            self.metrics_server = MetricsHttpServer(
                self.registry, self.metrics_host, self.requested_metrics_port
            )
        await self.set_serving(True)
        log.info(
            "serving",
            extra={
                "grpc_address": self.address,
                "advertise_address": self.advertised_address,
                "metrics_port": self.metrics_port,
                "services": self._service_names,
            },
        )
        for hook in self._start_hooks:
            await hook()
        if self.ready_file is not None:
            write_ready_file(
                self.ready_file,
                {
                    "name": self.name,
                    "pid": os.getpid(),
                    "grpc_address": self.address,
                    "advertise_address": self.advertised_address,
                    "grpc_port": self.port,
                    "metrics_port": self.metrics_port,
                },
            )

    def _enable_reflection(self) -> None:
        # Off unless asked for: it lists every method and message, and it streams, so it is one
        # more way to hold a connection open; with a token it needs the token like the rest.
        names = [*self._service_names, HEALTH_SERVICE, grpc_reflection.SERVICE_NAME]
        self._methods.update(method_paths(grpc_reflection.SERVICE_NAME))
        grpc_reflection.enable_server_reflection(names, self.server)

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server else None

    async def stop(self) -> None:
        """Graceful stop: NOT_SERVING, refuse new calls, drain in-flight ones, run hooks."""
        log.info("stopping: draining in-flight RPCs", extra={"grace_s": self.shutdown_grace_s})
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.shutdown_grace_s)
        for hook in reversed(self._shutdown_hooks):
            try:
                await hook()
            except Exception:
                log.exception("shutdown hook failed")
        if self.metrics_server is not None:
            self.metrics_server.stop()
        log.info("stopped")

    async def serve(self) -> None:
        """Starts, waits for SIGTERM/SIGINT (or ``request_stop``), then stops gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_requested.set)
        try:
            await self.start()
            await self._stop_requested.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self.stop()
