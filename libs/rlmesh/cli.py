"""``rlmesh``: the one command-line entry point. ``rlmesh --help`` lists the subcommands."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from importlib.metadata import entry_points
from types import FrameType

from rlmesh.runtime.cpu_env import quiet_deepspeed_on_cpu

SERVICE_GROUP = "rlmesh.services"


def service_entry_points() -> dict[str, object]:
    """Services installed under the ``rlmesh.services`` entry-point group, by name."""
    return {ep.name: ep for ep in entry_points(group=SERVICE_GROUP)}


def cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    services = service_entry_points()
    if args.service not in services:
        known = ", ".join(sorted(services)) or "none (is rlmesh installed? `pip install -e .`)"
        print(f"rlmesh serve: unknown service {args.service!r}; known: {known}", file=sys.stderr)
        return 2
    main = services[args.service].load()  # type: ignore[attr-defined]
    return int(main(rest) or 0)


def cmd_up(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.job.stack import run_stack

    return run_stack(
        config_path=args.config, overrides=rest, services=args.services, hold=args.hold, workdir=args.workdir
    )


def cmd_redis(args: argparse.Namespace, rest: list[str]) -> int:
    import secrets

    from rlmesh.config.loader import ENV_REDIS_PASSWORD
    from rlmesh.config.secrets import redact_url
    from rlmesh.runtime.launcher import ProcessLauncher

    given = os.environ.get(ENV_REDIS_PASSWORD)
    password = given or secrets.token_urlsafe(24)
    with ProcessLauncher(args.dir) as launcher:
        redis = launcher.start_redis(
            port=args.port,
            host=args.host,
            appendonly=not args.no_aof,
            password=password,
            maxmemory=args.maxmemory,
        )
        where = f"env {ENV_REDIS_PASSWORD}"
        if not given:
            # Not printed: a terminal's scroll-back and CI logs keep what is printed.
            path = redis.data_dir / "password"
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(password + "\n")
            where = f"{path} (mode 0600); export {ENV_REDIS_PASSWORD}=$(cat {path}) for rlmesh to use it"
        print(
            f"redis ready at {redact_url(redis.url)} (data in {redis.data_dir}; password: {where}); "
            "Ctrl-C stops it",
            flush=True,
        )
        while True:
            signal.pause()  # Ctrl-C or SIGTERM unwinds through the with-block, which stops redis


def cmd_config(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.config import ConfigError, keys_markdown_table, load_config
    from rlmesh.config.loader import dump_public_yaml

    if args.action == "keys":
        print(keys_markdown_table())
        return 0
    from rlmesh.config.placement import PlacementError, plan_gpus

    try:
        cfg = load_config(args.config, rest)
        plan = plan_gpus(cfg)
    except (ConfigError, PlacementError) as e:
        print(f"invalid configuration:\n{e}", file=sys.stderr)
        return 2
    if args.action == "show":
        print(dump_public_yaml(cfg), end="")  # secrets masked: output gets pasted into issues
        if plan is not None:  # as YAML comments: the output still loads as a config
            print("\n".join(f"# {line}" for line in plan.describe().splitlines()))
        return 0
    if args.schema_only:
        print("configuration is valid (--schema-only: the model, data and reward it names are not checked)")
        return 0
    from rlmesh.job.preflight import format_problems, run_preflight

    report = run_preflight(cfg, progress=lambda step: print(f"checking: {step}", file=sys.stderr, flush=True))
    if report.problems:
        count = f"{len(report.problems)} problem{'s' if len(report.problems) > 1 else ''}"
        print(f"invalid configuration: {count}:\n{format_problems(report)}", file=sys.stderr)
        return 2
    print("configuration is valid")
    for line in report.checked:
        print(f"  {line}")
    for note in [*report.notes, *([report.finished.line()] if report.finished else [])]:
        print(f"note: {note}")
    return 0


def cmd_health(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.runtime.health import grpc_health

    status = grpc_health(args.address, args.service, timeout_s=args.timeout)
    print(f"{args.address} {args.service or '<server>'}: {status}")
    return 0 if status == "SERVING" else 1


def cmd_data(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.data.cli import main as data_main

    return data_main(rest)


def cmd_engine(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.engine.http_server import main as engine_main

    return engine_main(rest)


def cmd_demo(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.job.demo import main as demo_main

    return demo_main(rest)


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.job.train import main as train_main

    return train_main(rest)


def cmd_sft(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.learner.sft import main as sft_main

    return sft_main(rest)


def cmd_export(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.learner.checkpoints.export import main as export_main

    return export_main(rest)


def cmd_ray(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.ray.cli import main as ray_main

    return ray_main(rest)


def cmd_ctl(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.control.ctl import main as ctl_main

    return ctl_main(rest)


def cmd_protos(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.wire.protogen import main as protogen_main

    return protogen_main(rest)


def cmd_forkserver(args: argparse.Namespace, rest: list[str]) -> int:
    from rlmesh.runtime.forkserver import serve

    forked = serve(args.socket, _preload_for_forks)  # returns only in a forked child
    return main(forked)


def _preload_for_forks() -> None:
    """What the services import: torch, transformers' auto classes, DeepSpeed, the embedded engine
    and every service of the ``rlmesh.services`` entry points."""
    import importlib
    from importlib.metadata import entry_points

    import torch  # noqa: F401
    import transformers

    # DeepSpeed's autotuner imports mlflow where it is installed: 1.5 s, and pyarrow's allocator
    # thread, which would leave the server unable to fork. Autotuning is not used.
    hide_mlflow = "mlflow" not in sys.modules
    if hide_mlflow:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed  # noqa: F401
    finally:
        if hide_mlflow:
            del sys.modules["mlflow"]
    _ = (transformers.AutoModelForCausalLM, transformers.AutoTokenizer, transformers.AutoConfig)
    importlib.import_module("rlmesh.engine.http_server")
    for entry in entry_points(group="rlmesh.services"):
        importlib.import_module(entry.value.split(":", 1)[0])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlmesh", description="PPO post-training for language models as decoupled services."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "serve",
        help="run one service (reward, reference, rollout, learner, control) in the foreground",
        add_help=False,
    )
    p.add_argument("service")
    p.set_defaults(func=cmd_serve, passthrough=True)

    p = sub.add_parser("up", help="start a private Redis and every service, check their health, stop them")
    p.add_argument("--config", "-c", help="YAML config file (verl key names)")
    p.add_argument(
        "--services",
        default="reward,reference,rollout,learner,control",
        help="comma-separated services to start (control only while rlmesh.control.enabled, as in rlmesh train)",
    )
    p.add_argument("--hold", action="store_true", help="keep everything running until Ctrl-C")
    p.add_argument("--workdir", help="where logs and Redis data go (default: runs/<run id>)")
    p.set_defaults(func=cmd_up, passthrough=True)

    p = sub.add_parser(
        "redis",
        help="run a private redis-server with a password (env RLMESH_REDIS_PASSWORD, else generated) "
        "on a free port until Ctrl-C",
    )
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument(
        "--maxmemory",
        default="0",
        help="Redis maxmemory (e.g. 2gb; 0 = no limit); past it writes fail, no stream entry is evicted",
    )
    p.add_argument("--dir", default=None, help="data directory (default: temporary)")
    p.add_argument("--no-aof", action="store_true", help="turn the append-only file off")
    p.set_defaults(func=cmd_redis, passthrough=False)

    p = sub.add_parser(
        "config",
        help="show or validate a configuration (validate also loads the model's config and tokenizer, reads "
        "the data, calls the reward on its first rows, and says whether the run is already finished), or "
        "list every key",
    )
    p.add_argument("action", choices=["show", "validate", "keys"])
    p.add_argument("--config", "-c", help="YAML config file")
    p.add_argument(
        "--schema-only",
        action="store_true",
        help="validate: the keys, values and cross-field rules only, not the files the config names "
        "(for a machine without the model or data)",
    )
    p.set_defaults(func=cmd_config, passthrough=True)

    p = sub.add_parser("health", help="gRPC health check of a service")
    p.add_argument("address", help="host:port")
    p.add_argument("--service", default="", help="service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=2.0)
    p.set_defaults(func=cmd_health, passthrough=False)

    p = sub.add_parser(
        "data", help="write verl-layout Parquet: the arithmetic task, or GSM8K converted", add_help=False
    )
    p.set_defaults(func=cmd_data, passthrough=True)

    p = sub.add_parser(
        "engine", help="the embedded CPU engine: an HF model behind SGLang's HTTP API", add_help=False
    )
    p.set_defaults(func=cmd_engine, passthrough=True)

    p = sub.add_parser(
        "demo",
        help="the CPU demo: a tiny model learns arithmetic with PPO, every role a process",
        add_help=False,
    )
    p.set_defaults(func=cmd_demo, passthrough=True)

    p = sub.add_parser(
        "train",
        help="run a PPO job from a config (verl's main_ppo): start its services, train, export the actor",
        add_help=False,
    )
    p.set_defaults(func=cmd_train, passthrough=True)

    p = sub.add_parser("sft", help="supervised warm-up of a model on a verl-layout parquet", add_help=False)
    p.set_defaults(func=cmd_sft, passthrough=True)

    p = sub.add_parser(
        "export", help="write the actor of a checkpoint as an HF directory (LoRA merged)", add_help=False
    )
    p.set_defaults(func=cmd_export, passthrough=True)

    p = sub.add_parser(
        "ray", help="run a job on a Ray cluster, every service an actor (up, down)", add_help=False
    )
    p.set_defaults(func=cmd_ray, passthrough=True)

    p = sub.add_parser(
        "ctl",
        help="drive a running job through its control plane: status, metrics, pause, hyper-parameters, "
        "replicas, rewards, queues, audit",
        add_help=False,
    )
    p.set_defaults(func=cmd_ctl, passthrough=True)

    p = sub.add_parser("protos", help="regenerate the gRPC code in libs/rlmesh/v1 from protos/")
    p.set_defaults(func=cmd_protos, passthrough=True)

    p = sub.add_parser(
        "forkserver",
        help="(started by rlmesh train, demo and up) import the services once and fork each from here",
    )
    p.add_argument("socket")
    p.set_defaults(func=cmd_forkserver, passthrough=False)
    return parser


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _plain_config_warnings() -> None:
    """A config warning is for the user, not a traceback: ``rlmesh: warning: ...`` on stderr."""
    from rlmesh.config import ConfigWarning

    default = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):  # type: ignore[no-untyped-def]
        if issubclass(category, ConfigWarning):
            return f"rlmesh: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = fmt


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if not args.passthrough and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command != "serve":
        # SIGTERM unwinds like Ctrl-C, so `with ProcessLauncher()` blocks stop their children.
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        # A shell starts background jobs with SIGINT ignored, and Python then leaves it ignored:
        # Ctrl-C (or a SIGINT from a supervisor) must stop what these commands started all the same.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    quiet_deepspeed_on_cpu(os.environ)  # before anything imports transformers (and DeepSpeed)
    _plain_config_warnings()
    try:
        code = int(args.func(args, rest) or 0)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        code = 130
    if args.command in SERVICE_COMMANDS:
        exit_now(code)
    return code


# A service has stopped by the time its command returns (its server closed, its children and
# connections gone, its files flushed): the interpreter's own teardown (torch, DeepSpeed, gloo) adds
# a second or more to every stop and cannot change what the service left behind.
SERVICE_COMMANDS = ("serve", "engine")


def exit_now(code: int) -> None:
    """Flushes logs and the standard streams, then ends the process with ``code`` at once."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
