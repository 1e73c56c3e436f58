"""``rlmesh serve control``: the control plane's process: the REST API (uvicorn) on
``rlmesh.control.port``, its metrics also on ``rlmesh.control.metrics_port``, a ready file, and on
SIGTERM a graceful stop (requests under way finish). docs/control.md"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence

import uvicorn

from rlmesh.config import ENV_AUTH_TOKEN, ConfigError, load_config
from rlmesh.control.app import create_app
from rlmesh.control.metrics import ControlMetrics
from rlmesh.runtime.entry import service_arg_parser
from rlmesh.runtime.http_guard import http_limits
from rlmesh.runtime.logs import configure_logging
from rlmesh.runtime.metrics import MetricsHttpServer
from rlmesh.runtime.net import OpenBindError, advertised_address, check_open_bind
from rlmesh.runtime.ready_file import write_ready_file
from rlmesh.runtime.tls import export_tls, tls_of, uvicorn_ssl

log = logging.getLogger("rlmesh.control")

DESCRIPTION = (
    "The control plane: a REST API (OpenAPI at /docs) over a running job's learner, replicas, reward "
    "services and queues. Settings: rlmesh.control.* keys, e.g. rlmesh.control.port=8000 "
    "rlmesh.control.auto.enabled=true; the learner at rlmesh.learner.addresses."
)


class Server(uvicorn.Server):
    """uvicorn, minus one habit: once drained after a SIGTERM it raises the signal again, so the
    process would die by it. A service exits 0 after a clean stop (docs/design.md#the-processes)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = service_arg_parser("control", DESCRIPTION).parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rlmesh control: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    token = cfg.rlmesh.token()
    if token:
        os.environ[ENV_AUTH_TOKEN] = token  # never argv: docs/design.md#tokens
    export_tls(tls_of(cfg.rlmesh.security.tls))  # its gRPC clients (the learner, replicas) read it
    section = cfg.rlmesh.control
    configure_logging("control", cfg.rlmesh.run_id, cfg.rlmesh.log_level, cfg.rlmesh.log_format)
    try:
        check_open_bind(
            section.host,
            "the control plane (rlmesh.control.host)",
            token,
            cfg.rlmesh.security.allow_open_bind,
        )
    except OpenBindError as e:
        print(f"rlmesh control: {e}", file=sys.stderr)
        return 2
    family = socket.AF_INET6 if ":" in section.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((section.host.strip("[]"), section.port))
        port = sock.getsockname()[1]
        advertise = advertised_address(
            section.host,
            port,
            advertise=section.advertise_address,
            key="rlmesh.control.advertise_address",
            redis_url=cfg.rlmesh.redis_url,
        )
    except (OSError, ValueError) as e:
        print(f"rlmesh control: cannot listen on {section.host}:{section.port}: {e}", file=sys.stderr)
        return 2
    metrics = ControlMetrics()
    metrics_server = MetricsHttpServer(metrics.registry, section.host, section.metrics_port)
    host = (
        "127.0.0.1" if section.host in ("0.0.0.0", "") else "[::1]" if section.host == "::" else section.host
    )

    def ready() -> None:
        if args.ready_file:
            write_ready_file(
                args.ready_file,
                {
                    "name": "control",
                    "pid": os.getpid(),
                    "protocol": "http",
                    "grpc_address": f"{host}:{port}",  # the launcher's name for "where it serves"
                    "advertise_address": advertise,
                    "grpc_port": port,
                    "url": f"{'https' if cfg.rlmesh.security.tls.enabled else 'http'}://{advertise}",
                    "metrics_port": metrics_server.port,
                },
            )

    app = create_app(cfg, metrics=metrics, on_ready=ready, own_hosts=[advertise])
    grace = cfg.rlmesh.runtime.shutdown_grace_s
    security = cfg.rlmesh.security
    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=grace,
        access_log=False,
        **http_limits(security.http_max_concurrency, security.http_keep_alive_timeout_s),
        **uvicorn_ssl(tls_of(security.tls)),
    )
    server = Server(config)
    try:
        server.run(sockets=[sock])  # returns after SIGTERM or SIGINT, drained
    except Exception:
        log.exception("control plane failed")
        return 1
    finally:
        metrics_server.stop()
    return 0 if server.started else 1  # not started: its start-up failed, and uvicorn logged why
