"""``rlmesh ray up|down``: the command line of the Ray launcher (docs/ray.md)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rlmesh.ray.plan import SERVICES, PlanError, parse_service_values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlmesh ray", description="Run a PPO job on a Ray cluster, every service an actor."
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    services = ", ".join(SERVICES)
    address = os.environ.get("RAY_ADDRESS", "auto")

    up = sub.add_parser(
        "up",
        help="place every service on the cluster, run the job to its end, stop every actor",
        epilog="Several --num-cpus, --num-gpus and --resources flags may be given, one per service "
        f"({services}). Ctrl-C or SIGTERM stops every actor and what it started.",
    )
    up.add_argument("--config", "-c", default=None, help="YAML config file (verl key names)")
    up.add_argument("--address", default=address, help=f"the Ray cluster (default: {address})")
    up.add_argument(
        "--num-cpus", action="append", default=[], metavar="SERVICE=N", help="CPUs an actor asks for"
    )
    up.add_argument(
        "--num-gpus",
        action="append",
        default=[],
        metavar="SERVICE=N",
        help="GPUs an actor asks for (default: from the config, 0 on CPU)",
    )
    up.add_argument(
        "--resources",
        action="append",
        default=[],
        metavar="SERVICE=JSON",
        help="custom Ray resources an actor asks for, e.g. rollout='{\"gpu_node\": 1}'",
    )
    up.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="times Ray restarts each rollout replica's actor, and the learner's when it dies (killed, "
        "or a rank of it lost; it resumes from its latest checkpoint) (default 3)",
    )
    up.add_argument(
        "--workdir", default=None, help="logs and Redis data (default: <checkpoints>/services/<run>)"
    )
    up.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    down = sub.add_parser("down", help="stop the actors of a run (or of every rlmesh run) on the cluster")
    down.add_argument("--address", default=address, help=f"the Ray cluster (default: {address})")
    down.add_argument("--run-id", default=None, help="the run to stop (default: every rlmesh run)")
    down.add_argument("--grace", type=float, default=30.0, help="seconds a service has to stop (default 30)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # parse_intermixed_args does not take subcommands: overrides after a flag come back as extras.
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if extra and (args.action != "up" or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.action == "up":
        try:
            flags = {
                "num_cpus": parse_service_values(args.num_cpus, "--num-cpus", "number"),
                "num_gpus": parse_service_values(args.num_gpus, "--num-gpus", "number"),
                "resources": parse_service_values(args.resources, "--resources", "json"),
            }
        except PlanError as e:
            print(f"rlmesh ray up: {e}", file=sys.stderr)
            return 2
    try:
        import ray  # noqa: F401
    except ImportError:
        print(
            "rlmesh ray: Ray is not installed; install the extra: pip install 'rlmesh[cluster]'",
            file=sys.stderr,
        )
        return 2
    if args.action == "down":
        from rlmesh.ray.down import run_down

        return run_down(args.address, args.run_id, args.grace)
    from rlmesh.ray.up import UpOptions, run_up

    opts = UpOptions(
        config=args.config,
        overrides=list(args.overrides),
        address=args.address,
        max_restarts=args.max_restarts,
        workdir=args.workdir,
        **flags,
    )
    return run_up(opts)
