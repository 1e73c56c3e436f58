"""``service_main``: the one entry point every service's ``main`` delegates to.

docs/design.md#the-processes"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence

from rlmesh.config import ENV_AUTH_TOKEN, ConfigError, RLMeshConfig, load_config
from rlmesh.runtime.affinity import apply_cpu_affinity
from rlmesh.runtime.logs import configure_logging
from rlmesh.runtime.net import OpenBindError, advertised_address, check_open_bind
from rlmesh.runtime.server import GrpcService
from rlmesh.runtime.tls import export_tls, tls_of

BuildService = Callable[[GrpcService, RLMeshConfig], Awaitable[None]]

log = logging.getLogger("rlmesh.runtime")


class CannotStart(Exception):
    """Raised by a service's build when what it serves cannot be made (a model or function that
    does not load): the service exits 2 with the message, like an invalid config."""


def limit_torch_threads() -> None:
    """One intra-op thread unless OMP_NUM_THREADS says otherwise: on small CPU machines torch's
    default oversubscribes the cores and a step runs an order of magnitude slower."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def service_arg_parser(name: str, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"rlmesh serve {name}", description=description)
    parser.add_argument("--config", "-c", help="YAML config file (verl key names)")
    parser.add_argument("--ready-file", help="write {pid, grpc_port, metrics_port} as JSON here once serving")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rlmesh.reward.port=50051")
    return parser


def service_main(
    name: str, build: BuildService, argv: Sequence[str] | None = None, description: str | None = None
) -> int:
    limit_torch_threads()
    args = service_arg_parser(name, description).parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rlmesh {name}: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    token = cfg.rlmesh.token()
    if token:
        # Where the token reaches what the config does not: this process's engine clients (the
        # learner's weight pushes) and its children (a replica's engine), never through argv.
        os.environ[ENV_AUTH_TOKEN] = token
    section = getattr(cfg.rlmesh, name)
    tls = tls_of(cfg.rlmesh.security.tls)
    try:
        if tls is not None:
            tls.check()
    except FileNotFoundError as e:
        print(f"rlmesh {name}: invalid configuration:\n{e} (rlmesh.security.tls)", file=sys.stderr)
        return 2
    export_tls(tls)  # this process's clients, and its children (a replica's engine), read it there
    configure_logging(name, cfg.rlmesh.run_id, cfg.rlmesh.log_level, cfg.rlmesh.log_format)
    try:
        apply_cpu_affinity(section.cpus, f"rlmesh.{name}.cpus")
    except ValueError as e:
        print(f"rlmesh {name}: invalid configuration:\n{e}", file=sys.stderr)
        return 2

    def advertise(port: int) -> str:
        return advertised_address(
            section.host,
            port,
            advertise=section.advertise_address,
            key=f"rlmesh.{name}.advertise_address",
            redis_url=cfg.rlmesh.redis_url,
        )

    try:
        advertise(section.port or 1)  # a bad RLMESH_ADVERTISE_HOST fails here, not once serving
    except ValueError as e:
        print(f"rlmesh {name}: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    try:
        check_open_bind(
            section.host,
            f"the {name} service (rlmesh.{name}.host)",
            token,
            cfg.rlmesh.security.allow_open_bind,
        )
    except OpenBindError as e:
        print(f"rlmesh {name}: {e}", file=sys.stderr)
        return 2

    async def run() -> int:
        service = GrpcService(
            name,
            host=section.host,
            port=section.port,
            advertise=advertise,
            metrics_port=section.metrics_port,
            auth_token=token,
            shutdown_grace_s=cfg.rlmesh.runtime.shutdown_grace_s,
            ready_file=args.ready_file,
            max_request_bytes=cfg.rlmesh.runtime.grpc_max_request_mb * 1024 * 1024,
            max_concurrent_rpcs=cfg.rlmesh.runtime.grpc_max_concurrent_rpcs,
            reflection=cfg.rlmesh.security.grpc_reflection,
            tls=tls,
        )
        await build(service, cfg)
        await service.serve()
        return service.exit_code

    try:
        return asyncio.run(run())
    except CannotStart as e:
        log.error("cannot start: %s", e)
        print(f"rlmesh {name}: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception:
        log.exception("service failed")
        return 1
