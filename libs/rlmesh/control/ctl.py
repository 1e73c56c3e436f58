"""``rlmesh ctl``: the control plane's REST API from a shell. Where: ``--url``, env
``RLMESH_CONTROL_URL`` or the config; the token from env ``RLMESH_AUTH_TOKEN`` or the config, never
from the command line (``ps`` shows argv to everyone). docs/control.md#rlmesh-ctl"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from rlmesh.config import ConfigError, load_config
from rlmesh.config.hparams import HPARAMS
from rlmesh.runtime.tls import client_ssl_context, export_tls, tls_from_env, tls_of

ENV_URL = "RLMESH_CONTROL_URL"
API = "/api/v1"


def control_url(url: str | None, config: str | None) -> tuple[str, str | None]:
    """The base URL and the token to call it with."""
    cfg = load_config(config, [])
    if not url:
        url = os.environ.get(ENV_URL)
    if not url:
        scheme = "https" if cfg.rlmesh.security.tls.enabled else "http"
        url = f"{scheme}://{cfg.rlmesh.control.client_addresses()[0]}"
    export_tls(tls_of(cfg.rlmesh.security.tls))  # an https:// URL is checked against the run's CA
    return url.rstrip("/"), cfg.rlmesh.auth_token


def parse_assignments(items: Sequence[str]) -> dict[str, float]:
    """``name=value`` pairs; a usage error names the bad one."""
    values = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in HPARAMS:
            raise SystemExit(
                f"rlmesh ctl set: {item!r}: expected NAME=VALUE, NAME one of {', '.join(HPARAMS)}"
            )
        try:
            values[name] = float(value)
        except ValueError:
            raise SystemExit(f"rlmesh ctl set: {item!r}: {value!r} is not a number") from None
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlmesh ctl",
        description="Drive a running job through its control plane (docs/control.md). The token comes from "
        "env RLMESH_AUTH_TOKEN or the config, never from the command line.",
    )
    p.add_argument(
        "--url",
        help=f"the control plane, e.g. http://127.0.0.1:8000 (default: env {ENV_URL}, "
        "else rlmesh.control of --config)",
    )
    p.add_argument("--config", "-c", help="YAML config: where the control plane is, and the token")
    p.add_argument("--json", action="store_true", help="print the API's JSON as it is")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request (checkpoint: longer)")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    sub.add_parser("status", help="step, phase, ETA, hyper-parameters, last metrics")
    m = sub.add_parser("metrics", help="metric history by key and step range")
    m.add_argument("keys", nargs="*", help="metric names (all when none)")
    m.add_argument("--start", type=int, default=0)
    m.add_argument("--end", type=int, default=None)
    sub.add_parser("validation", help="validation results by step")
    sub.add_parser("config", help="the config as the learner resolved it")
    for name, what in (
        ("pause", "finish the current step, then hold"),
        ("resume", "go on training"),
        ("checkpoint", "checkpoint at the next step boundary"),
    ):
        sub.add_parser(name, help=what)
    s = sub.add_parser("stop", help="graceful stop: end the step, checkpoint, exit (resumable)")
    s.add_argument("--no-checkpoint", action="store_true", help="exit without a final checkpoint")
    sub.add_parser("hparams", help="the live hyper-parameters and their ranges")
    s = sub.add_parser("set", help="change live hyper-parameters: set actor_lr=5e-7 kl_coef=0.02")
    s.add_argument("assignments", nargs="+", metavar="NAME=VALUE")
    r = sub.add_parser("replicas", help="rollout replicas: list, drain ID, remove ID")
    r.add_argument("action", choices=["list", "drain", "remove"], nargs="?", default="list")
    r.add_argument("replica_id", nargs="?")
    r.add_argument("--timeout-s", type=float, default=60.0, help="drain: how long in-flight tasks may take")
    w = sub.add_parser("rewards", help="reward services: list, add ADDR, remove ADDR, swap ADDR...")
    w.add_argument("action", choices=["list", "add", "remove", "swap"], nargs="?", default="list")
    w.add_argument("addresses", nargs="*", metavar="HOST:PORT")
    w.add_argument("--force", action="store_true", help="even if a new service is not SERVING")
    sub.add_parser("queues", help="queue depths, pending entries, dead letters")
    d = sub.add_parser("dead-letters", help="dead letters: list, replay ID")
    d.add_argument("action", choices=["list", "replay"], nargs="?", default="list")
    d.add_argument("dead_letter_id", nargs="?")
    d.add_argument("--limit", type=int, default=100)
    a = sub.add_parser("audit", help="who changed what, when")
    a.add_argument("--limit", type=int, default=50)
    a.add_argument("--action", default=None, help="only this action (set_hyperparam, pause, ...)")
    return p


def request_for(args: argparse.Namespace) -> tuple[str, str, dict[str, Any]]:
    """(method, path, httpx keyword arguments) of a parsed command."""
    c = args.cmd
    if c == "status":
        return "GET", "/run/status", {}
    if c == "metrics":
        params: dict[str, Any] = {"start": args.start}
        if args.keys:
            params["keys"] = ",".join(args.keys)
        if args.end is not None:
            params["end"] = args.end
        return "GET", "/run/metrics", {"params": params}
    if c in ("validation", "config"):
        return "GET", f"/run/{c}", {}
    if c in ("pause", "resume", "checkpoint"):
        return "POST", f"/run/{c}", {}
    if c == "stop":
        return "POST", "/run/stop", {"json": {"checkpoint": not args.no_checkpoint}}
    if c == "hparams":
        return "GET", "/hyperparams", {}
    if c == "set":
        return "PATCH", "/hyperparams", {"json": parse_assignments(args.assignments)}
    if c == "replicas":
        if args.action == "list":
            return "GET", "/replicas", {}
        if not args.replica_id:
            raise SystemExit(f"rlmesh ctl replicas {args.action}: give the replica id")
        if args.action == "drain":
            return "POST", f"/replicas/{args.replica_id}/drain", {"json": {"timeout_s": args.timeout_s}}
        return "DELETE", f"/replicas/{args.replica_id}", {}
    if c == "rewards":
        if args.action == "list":
            return "GET", "/rewards", {}
        if not args.addresses:
            raise SystemExit(f"rlmesh ctl rewards {args.action}: give HOST:PORT")
        if args.action == "add":
            return "POST", "/rewards", {"json": {"address": args.addresses[0], "force": args.force}}
        if args.action == "remove":
            return "DELETE", f"/rewards/{args.addresses[0]}", {}
        return "PUT", "/rewards", {"json": {"addresses": args.addresses, "force": args.force}}
    if c == "queues":
        return "GET", "/queues", {}
    if c == "dead-letters":
        if args.action == "list":
            return "GET", "/dead-letters", {"params": {"limit": args.limit}}
        if not args.dead_letter_id:
            raise SystemExit("rlmesh ctl dead-letters replay: give the dead letter's id")
        return "POST", f"/dead-letters/{args.dead_letter_id}/replay", {}
    if c == "audit":
        params = {"limit": args.limit}
        if args.action:
            params["action"] = args.action
        return "GET", "/audit", {"params": params}
    raise SystemExit(f"rlmesh ctl: unknown command {c!r}")  # argparse rules this out


def show(cmd: str, body: Any) -> str:
    """A person's view of an answer: the status and the lists as lines, the rest as JSON."""
    if cmd == "status":
        eta = f"{body['eta_s']:.0f} s" if body.get("eta_s") is not None else "-"
        lines = [
            f"run {body['run_id']}: step {body['step']}/{body['total_steps']}, policy v{body['policy_version']}, "
            f"{body['phase']}{' (paused)' if body['paused'] else ''}, ETA {eta}",
            f"replicas {body['live_replicas']}, last checkpoint {body['last_checkpoint'] or '-'}",
            "hyper-parameters: " + ", ".join(f"{k}={v:g}" for k, v in sorted(body["hyperparams"].items())),
        ]
        lines += [
            f"  {k} = {v:.6g}"
            for k, v in sorted(body["metrics"].items())
            if not k.startswith("timing_start/")
        ]
        return "\n".join(lines)
    if cmd == "replicas" and "replicas" in body:
        rows = [
            f"{r['replica_id']:<16} {r['address']:<22} v{r['policy_version']:<5} {r['health']:<12} {r['state']:<9} "
            f"{(r['tokens_per_s'] or 0):>9.1f} tok/s  {r['tasks_in_flight'] if r['tasks_in_flight'] is not None else '-':>3} "
            f"in flight  heartbeat {r['heartbeat_age_s']:.1f} s ago"
            for r in body["replicas"]
        ]
        return "\n".join(rows) or "no live replica"
    if cmd == "audit":
        return (
            "\n".join(
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['time']))} {e['who']:<24} {e['source']:<7} "
                f"{e['action']} {e['target']}: {json.dumps(e['old'])} -> {json.dumps(e['new'])}"
                + (f"  ({e['detail']})" if e.get("detail") else "")
                for e in body["entries"]
            )
            or "no entries"
        )
    return json.dumps(body, indent=2)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        base, token = control_url(args.url, args.config)
    except ConfigError as e:
        print(f"rlmesh ctl: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    method, path, kw = request_for(args)
    headers = {"X-Rlmesh-User": f"{getpass.getuser()}@{socket.gethostname()}"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    timeout = 3600.0 if args.cmd in ("checkpoint", "replicas") else args.timeout
    try:
        tls = tls_from_env() if base.startswith("https:") else None
        verify = client_ssl_context(tls) if tls else True
        resp = httpx.request(
            method, f"{base}{API}{path}", headers=headers, timeout=timeout, verify=verify, **kw
        )
    except httpx.HTTPError as e:
        print(f"rlmesh ctl: {base}: {e}", file=sys.stderr)
        return 1
    try:
        body = resp.json()
    except ValueError:
        body = {"detail": resp.text}
    if resp.status_code >= 400:
        detail = body.get("detail", body) if isinstance(body, dict) else body
        print(
            f"rlmesh ctl: {resp.status_code}: {json.dumps(detail) if not isinstance(detail, str) else detail}",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(body, indent=2) if args.json else show(args.cmd, body))
    return 0
