"""``rlmesh engine``: the embedded CPU engine as an HTTP server speaking SGLang's native API.

The routes it serves: docs/sglang.md; the app: ``app.py``, the routes: ``routes_*.py``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
from collections.abc import Sequence
from types import FrameType

import torch
import uvicorn

from rlmesh.config.loader import ENV_AUTH_TOKEN
from rlmesh.engine.app import create_app
from rlmesh.engine.simulated import SimulationSpecError
from rlmesh.engine.state import EngineState
from rlmesh.runtime.entry import limit_torch_threads
from rlmesh.runtime.http_guard import http_limits
from rlmesh.runtime.logs import configure_logging
from rlmesh.runtime.net import OpenBindError, check_open_bind
from rlmesh.runtime.tls import tls_from_env, uvicorn_ssl

__all__ = ["create_app", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    limit_torch_threads()  # before the model loads, the first work torch does
    parser = argparse.ArgumentParser(prog="rlmesh engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="HF model directory (AutoModelForCausalLM)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind; beyond loopback, set RLMESH_AUTH_TOKEN"
    )
    parser.add_argument(
        "--allow-open-bind",
        action="store_true",
        help="bind beyond loopback without RLMESH_AUTH_TOKEN on purpose (rlmesh.security.allow_open_bind)",
    )
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (see --ready-file)")
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a Host header name it answers to besides loopback, IP addresses and --host (its "
        "advertised name; rlmesh.security.allowed_hosts); repeatable; '*' = any",
    )
    parser.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin (scheme://host[:port]) besides its own that may send POSTs "
        "(rlmesh.security.allowed_origins); repeatable; '*' = any",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=256,
        help="requests served at once; more get a 503 (rlmesh.security.http_max_concurrency)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open (rlmesh.security.http_keep_alive_timeout_s)",
    )
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument(
        "--weight-sync-timeout", type=float, default=600.0, help="seconds for any weight collective"
    )
    parser.add_argument("--ready-file", help="write {pid, port} as JSON here once serving")
    parser.add_argument("--log-format", choices=["json", "text"], default="json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json-model-override-args",
        type=json.loads,
        default={},
        help="JSON object of HF config entries to override on load (SGLang's flag of the same name)",
    )
    args = parser.parse_args(argv)
    if args.max_concurrency < 1 or not args.keep_alive_timeout > 0:
        parser.error("--max-concurrency must be >= 1 and --keep-alive-timeout > 0")
    configure_logging("engine", os.environ.get("RLMESH_RUN_ID"), fmt=args.log_format)
    torch.manual_seed(args.seed)
    token = os.environ.get(ENV_AUTH_TOKEN) or None
    try:
        check_open_bind(args.host, "the engine (--host)", token, args.allow_open_bind)
    except OpenBindError as e:
        print(f"rlmesh engine: {e}", file=sys.stderr)
        return 2
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on connections accepted from a socket that
    # names it. Without it Nagle holds each response's body until the client ACKs the headers,
    # which a delayed ACK makes ~40 ms per request.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host.strip("[]"), args.port))
    port = {"port": sock.getsockname()[1]}
    try:
        app = create_app(
            args.model_path,
            max_batch_size=args.max_batch_size,
            weight_version=args.weight_version,
            skip_tokenizer_init=args.skip_tokenizer_init,
            weight_sync_timeout_s=args.weight_sync_timeout,
            ready_file=args.ready_file,
            port_holder=port,
            # From the environment, never an argument, which ps shows every user: docs/design.md#tokens
            auth_token=token,
            override_config=args.json_model_override_args,
            own_hosts=[args.host],
            allowed_hosts=args.allowed_host,
            allowed_origins=args.allowed_origin,
        )
    except SimulationSpecError as e:
        print(f"rlmesh engine: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=30,
        access_log=False,
        **http_limits(args.max_concurrency, args.keep_alive_timeout),
        # TLS from the environment its replica exported (rlmesh.security.tls), like the token.
        **uvicorn_ssl(tls_from_env()),
    )
    # uvicorn raises again the SIGTERM or SIGINT it has already served by stopping cleanly.
    with contextlib.suppress(KeyboardInterrupt):
        EngineServer(config, app.state.engine_state).run(sockets=[sock])
    return 0


class EngineServer(uvicorn.Server):
    """uvicorn's server, whose stop first abandons the waits for weight-group peers: its graceful
    shutdown waits for every request in flight, and such a wait lasts up to the group's deadline."""

    def __init__(self, config: uvicorn.Config, state: EngineState) -> None:
        super().__init__(config)
        self.engine_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.engine_state.stopping()
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    sys.exit(main())
