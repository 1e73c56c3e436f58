"""``rlmesh ctl``: the control plane's REST API from a shell. Where: ``--url``, env
``RLMESH_CONTROL_URL``, a running job's run file, else the config; the token from env
``RLMESH_AUTH_TOKEN`` or the config, never from the command line. docs/control.md#rlmesh-ctl"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from rlmesh.config import ConfigError, ConfigWarning, RLMeshConfig, load_config
from rlmesh.config.hparams import HPARAMS, range_text
from rlmesh.runtime.run_file import (
    RUN_FILE,
    RunInfo,
    is_live,
    read_run_file,
    running_jobs,
    tls_files,
    user_runs_dir,
)
from rlmesh.runtime.tls import TlsFiles, client_ssl_context, tls_of

ENV_URL = "RLMESH_CONTROL_URL"
API = "/api/v1"
# Options that take a value: what follows them is not a key=value override.
VALUE_OPTIONS = ("--url", "--config", "-c", "--timeout", "--run")
TOKEN_HINT = (
    "set env RLMESH_AUTH_TOKEN to the run's token, or give -c CONFIG with rlmesh.auth_token "
    "(never on the command line)"
)
Note = Callable[[str], None]


@dataclass
class Target:
    """Where a command goes, what said so (for the messages), and how to call it."""

    url: str
    source: str
    token: str | None
    tls: TlsFiles | None
    searched: str = ""  # where no run file was, when ``url`` is the configured address


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The arguments without the ``key=value`` overrides given before the command (as ``rlmesh
    train -c CONFIG key=value ...`` takes them), and those overrides."""
    rest: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in VALUE_OPTIONS:
            rest += argv[i : i + 2]
            i += 2
        elif arg.startswith("-"):
            rest.append(arg)
            i += 1
        elif "=" in arg:
            overrides.append(arg)
            i += 1
        else:  # the command: the rest is its own
            return rest + list(argv[i:]), overrides
    return rest, overrides


def quiet_config(config: str | None, overrides: Sequence[str] = ()) -> RLMeshConfig:
    """The config, without the warnings ``rlmesh train`` already gave about it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(config, list(overrides))


def live(info: RunInfo | None, note: Note) -> RunInfo | None:
    """``info`` while its job runs; a file a job left behind (killed) is said and skipped."""
    if info is not None and not is_live(info):
        note(f"ignoring {info.path}: its job (run {info.run_id}, pid {info.pid}) is no longer running")
        return None
    return info


def find_run(checkpoint_dir: Path | None, run_id: str | None, note: Note) -> tuple[RunInfo | None, str]:
    """The running job to call, and where its run file was looked for: ``--run``'s among the
    user's jobs; else the run file in the config's checkpoint directory (``-c``); else in this
    directory; else the only job of the user's running on this host."""
    if run_id:
        found = [r for r in running_jobs() if r.run_id == run_id]
        if not found:
            raise SystemExit(f"rlmesh ctl: no running job with run id {run_id!r} in {user_runs_dir()}")
        return found[-1], ""
    here = (checkpoint_dir if checkpoint_dir is not None else Path.cwd()) / RUN_FILE
    found_here = live(read_run_file(here), note)
    if found_here is not None:
        return found_here, ""
    if checkpoint_dir is not None:
        # A job started with other overrides (the demo's checkpoint directory is its own): name
        # the ones running, so the user can pick one.
        jobs = running_jobs()
        listing = "".join(f"; running: {r.run_id} (checkpoints in {r.checkpoint_dir})" for r in jobs)
        pick = ", pick one with --run RUN_ID" if jobs else ""
        return None, f"no run file at {here}{listing}{pick}"
    jobs = running_jobs()
    if len(jobs) > 1:
        listing = "".join(f"\n  {r.run_id}  {r.url}  checkpoints in {r.checkpoint_dir}" for r in jobs)
        raise SystemExit(
            f"rlmesh ctl: {len(jobs)} jobs are running; say which with --run RUN_ID, -c CONFIG, or "
            f"by running rlmesh ctl in its checkpoint directory:{listing}"
        )
    return (jobs[0] if jobs else None), f"no run file at {here}, none listed in {user_runs_dir()}"


def find_target(
    url: str | None, config: str | None, overrides: Sequence[str], run_id: str | None, note: Note
) -> Target:
    """Where to call and with which token: ``--url``, env ``RLMESH_CONTROL_URL``, the run file
    (``find_run``), else the configured ``rlmesh.control`` address."""
    cfg = quiet_config(config, overrides)
    token, tls = cfg.rlmesh.token(), tls_of(cfg.rlmesh.security.tls)
    if url:
        return Target(url.rstrip("/"), "--url", token, tls)
    if os.environ.get(ENV_URL):
        return Target(os.environ[ENV_URL].rstrip("/"), f"env {ENV_URL}", token, tls)
    configured = bool(config or overrides)
    checkpoint_dir = Path(cfg.trainer.default_local_dir).expanduser() if configured else None
    run, searched = find_run(checkpoint_dir, run_id, note)
    if run is not None:
        if not configured and run.config:  # the token the job took from its config file
            try:
                token = quiet_config(run.config).rlmesh.token()
            except (ConfigError, OSError) as e:
                note(f"could not read the run's config {run.config} for its token: {e}")
        return Target(run.url, f"the run file {run.path}", token, tls or tls_files(run))
    scheme = "https" if tls else "http"
    source = "rlmesh.control's default address"
    if configured:
        source = f"rlmesh.control of {config or 'the defaults'}{' with the overrides' if overrides else ''}"
    return Target(
        f"{scheme}://{cfg.rlmesh.control.client_addresses()[0]}", source, token, tls, searched=searched
    )


def parse_assignments(items: Sequence[str]) -> dict[str, float]:
    """``name=value`` pairs; a usage error names the bad one."""
    values = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"rlmesh ctl set: {item!r}: expected NAME=VALUE, e.g. actor_lr=1e-6")
        if name not in HPARAMS:
            raise SystemExit(
                f"rlmesh ctl set: unknown name {name!r}: the live hyper-parameters are {', '.join(HPARAMS)}"
            )
        try:
            values[name] = float(value)
        except ValueError:
            raise SystemExit(f"rlmesh ctl set: {item!r}: {value!r} is not a number") from None
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlmesh ctl",
        usage="rlmesh ctl [--url URL | -c CONFIG [key=value ...] | --run RUN_ID] [--json] COMMAND ...",
        description="Drive a running job through its control plane (docs/control.md). Where it is: "
        f"--url, env {ENV_URL}, the run file of a running `rlmesh train` ({RUN_FILE} in its "
        "checkpoint directory: -c CONFIG with the job's overrides, or this directory; else the only "
        "job of yours running), else rlmesh.control of the config. The token comes from env "
        "RLMESH_AUTH_TOKEN or the config, never from the command line.",
    )
    p.add_argument("--url", help="the control plane, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--config", "-c", help="the job's YAML config (key=value overrides may follow, as for rlmesh train)"
    )
    p.add_argument("--run", metavar="RUN_ID", help="the running job of yours with this run id")
    p.add_argument("--json", action="store_true", help="print the API's JSON as it is")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request (checkpoint: longer)")
    # --json after the command too: `rlmesh ctl status --json`.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print raw JSON")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    def command(name: str, what: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=what, parents=[common])

    command("status", "step, phase, ETA, hyper-parameters, last metrics")
    m = command("metrics", "metric history by key and step range")
    m.add_argument("keys", nargs="*", help="metric names (all when none)")
    m.add_argument("--start", type=int, default=0)
    m.add_argument("--end", type=int, default=None)
    command("validation", "validation results by step")
    command("config", "the config as the learner resolved it")
    for name, what in (
        ("pause", "finish the current step, then hold"),
        ("resume", "go on training"),
        ("checkpoint", "checkpoint at the next step boundary"),
    ):
        command(name, what)
    s = command("stop", "graceful stop: end the step, checkpoint, exit (resumable)")
    s.add_argument("--no-checkpoint", action="store_true", help="exit without a final checkpoint")
    command("hparams", "the live hyper-parameters and their ranges")
    s = command("set", "change live hyper-parameters: set actor_lr=5e-7 kl_coef=0.02")
    s.add_argument("assignments", nargs="+", metavar="NAME=VALUE")
    r = command("replicas", "rollout replicas: list, drain ID, remove ID")
    r.add_argument("action", choices=["list", "drain", "remove"], nargs="?", default="list")
    r.add_argument("replica_id", nargs="?")
    r.add_argument("--timeout-s", type=float, default=60.0, help="drain: how long in-flight tasks may take")
    x = command("autoscale", "the autoscaler's settings and last decision (rlmesh.control.autoscale)")
    x.add_argument(
        "--desired", action="store_true", help="print only the desired replica count (for scripts)"
    )
    w = command("rewards", "reward services: list, add ADDR, remove ADDR, swap ADDR...")
    w.add_argument("action", choices=["list", "add", "remove", "swap"], nargs="?", default="list")
    w.add_argument("addresses", nargs="*", metavar="HOST:PORT")
    w.add_argument("--force", action="store_true", help="even if a new service is not SERVING")
    command("queues", "queue depths, pending entries, dead letters")
    d = command("dead-letters", "dead letters: list, replay ID")
    d.add_argument("action", choices=["list", "replay"], nargs="?", default="list")
    d.add_argument("dead_letter_id", nargs="?")
    d.add_argument("--limit", type=int, default=100)
    a = command("audit", "who changed what, when")
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
    if c == "autoscale":
        return "GET", "/autoscale", {}
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


Show = Callable[[argparse.Namespace, dict[str, Any]], str]


def show_status(args: argparse.Namespace, body: dict[str, Any]) -> str:
    eta = f"{body['eta_s']:.0f} s" if body.get("eta_s") is not None else "-"
    state = body["phase"].replace("_", " ")
    if body["paused"] and body["phase"] != "paused":
        state += ", pausing after this step"
    message = body.get("message") or ""
    if message.startswith(state):  # "paused since start (...)": the message says it all
        state = message
    elif message:
        state += f" ({message})"
    lines = [
        f"run {body['run_id']}: step {body['step']}/{body['total_steps']}, policy v{body['policy_version']}, "
        f"{state}, ETA {eta}",
        f"replicas {body['live_replicas']}, last checkpoint {body['last_checkpoint'] or '-'}",
        "hyper-parameters: " + ", ".join(f"{k}={v:g}" for k, v in sorted(body["hyperparams"].items())),
    ]
    metrics = {k: v for k, v in body["metrics"].items() if not k.startswith("timing_start/")}
    shown = [k for k in STATUS_METRICS if k in metrics]
    lines += [f"  {k} = {metrics[k]:.6g}" for k in shown]
    if len(metrics) > len(shown):
        lines.append(f"  ({len(metrics) - len(shown)} more: rlmesh ctl metrics; every one: --json)")
    return "\n".join(lines)


# The last step's metrics a status shows: reward, validation, KL, the update, lengths, time.
STATUS_METRICS = (
    "critic/score/mean",
    "val/score",
    "actor/reward_kl_penalty",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/lr",
    "response_length/mean",
    "reward/failed_ratio",
    "timing_s/step",
)
WIDE = 6  # more metrics than this: one block per step instead of a column each


def show_rows(args: argparse.Namespace, body: dict[str, Any]) -> str:
    """``metrics`` and ``validation``: a column per metric, or a block per step when many; with
    no key and no range, every metric of every step would be thousands of lines: the last step's."""
    keys = sorted({k for row in body["rows"] for k in row["metrics"] if not k.startswith("timing_start/")})
    rows = [row for row in body["rows"] if any(k in row["metrics"] for k in keys)]
    if not rows:
        return "no metrics logged yet" if args.cmd == "metrics" else "no validation yet"
    if len(keys) <= WIDE:
        return table(keys, rows)
    head = ""
    if args.cmd == "metrics" and not args.keys and args.start == 0 and args.end is None:
        head = f"{len(rows)} steps logged, the last below; a metric's history: rlmesh ctl metrics KEY...\n"
        rows = rows[-1:]
    return head + "\n".join(
        f"step {row['step']}\n"
        + "\n".join(f"  {k} = {v:.6g}" for k, v in sorted(row["metrics"].items()) if k in keys)
        for row in rows
    )


def table(keys: list[str], rows: list[dict[str, Any]]) -> str:
    """A column per metric, a line per step."""
    widths = [max(len(k), 10) for k in keys]
    lines = ["step  " + "  ".join(f"{k:>{w}}" for k, w in zip(keys, widths, strict=True))]
    for row in rows:
        cells = [
            f"{row['metrics'][k]:>{w}.6g}" if k in row["metrics"] else f"{'-':>{w}}"
            for k, w in zip(keys, widths, strict=True)
        ]
        lines.append(f"{row['step']:>4}  " + "  ".join(cells))
    return "\n".join(lines)


def show_config(args: argparse.Namespace, body: dict[str, Any]) -> str:
    source = "the learner's" if body["source"] == "learner" else "the control plane's (the learner's not yet)"
    text = yaml.safe_dump(body["config"], sort_keys=False, default_flow_style=False)
    return f"# {source} resolved config, secrets masked\n{text.rstrip()}"


def show_action(args: argparse.Namespace, body: dict[str, Any]) -> str:
    # The learner's phase right after the call is the one it is leaving: the step says where it is.
    if args.cmd == "pause":
        return f"pausing: the learner holds once its current step is done (step {body['step']})"
    if args.cmd == "resume":
        return f"resumed at step {body['step']}"
    after = (
        "exits without a checkpoint"
        if args.no_checkpoint
        else "checkpoints and exits (the same command resumes)"
    )
    return f"stopping: the learner ends its current step (step {body['step']}), {after}"


def show_checkpoint(args: argparse.Namespace, body: dict[str, Any]) -> str:
    return f"checkpoint of step {body['step']}: {body['path']}"


def show_hparams(args: argparse.Namespace, body: dict[str, Any]) -> str:
    lines = [f"{'name':<14} {'value':>10}  {'range':<10} config key"]
    for name, f in body["fields"].items():
        value = body["values"].get(name)
        shown = f"{value:>10g}" if value is not None else f"{'-':>10}"
        bounds = f"{'(' if f['min_exclusive'] else '['}{f['min']:g}, {f['max']:g}]"
        lines.append(f"{name:<14} {shown}  {bounds:<10} {f['key']}")
    return "\n".join(lines)


def show_set(args: argparse.Namespace, body: dict[str, Any]) -> str:
    asked = parse_assignments(args.assignments)
    values = body["values"]
    return f"from step {body['applies_from_step']} on:\n" + "\n".join(
        f"  {name} = {values.get(name, value):g}" for name, value in asked.items()
    )


def show_replicas(args: argparse.Namespace, body: dict[str, Any]) -> str:
    if args.action == "drain":
        done = "drained" if body["drained"] else "not drained in time"
        back = f", {body['unfinished']} unfinished tasks back on the queue" if body.get("unfinished") else ""
        return f"{body['replica_id']}: {done}{back}" + (f": {body['message']}" if body.get("message") else "")
    if args.action == "remove":
        return f"{body['replica_id']}: removed ({body['detail']})"
    rows = [
        f"{r['replica_id']:<16} {r['address']:<22} v{r['policy_version']:<5} {r['health']:<12} {r['state']:<9} "
        f"{(r['tokens_per_s'] or 0):>9.1f} tok/s  {r['tasks_in_flight'] if r['tasks_in_flight'] is not None else '-':>3} "
        f"in flight  heartbeat {r['heartbeat_age_s']:.1f} s ago"
        for r in body["replicas"]
    ]
    return "\n".join(rows) or "no live replica"


def show_autoscale(args: argparse.Namespace, body: dict[str, Any]) -> str:
    last, settings = body["last"], body["settings"]
    if args.desired:
        if last is None:
            raise SystemExit(
                "rlmesh ctl autoscale: no decision yet (rlmesh.control.autoscale.enabled is false?)"
            )
        return str(last["desired"])
    bounds = f"between {settings['min_replicas']} and {settings['max_replicas']} replicas"
    if not settings["enabled"]:
        return f"autoscaler off (rlmesh.control.autoscale.enabled=false); would keep {bounds}"
    if last is None:
        return f"autoscaler on, {bounds}: no decision yet"
    mu = last["replica_tasks_per_s"]
    return "\n".join(
        [
            f"desired {last['desired']} replicas ({bounds}), {last['live']} live; the load calls for {last['wanted']}",
            f"  why: {last['reason']}",
            f"  tasks: {last['arrival_tasks_per_s']:.3g}/s arriving, {last['done_tasks_per_s']:.3g}/s finished, "
            f"{last['tasks_outstanding']} outstanding ({last['tasks_claimed']} claimed); a replica finishes "
            f"{'-' if mu is None else f'{mu:.3g}/s'}; {last['learner_backlog']} trajectories wait for the learner",
        ]
    )


def show_rewards(args: argparse.Namespace, body: dict[str, Any]) -> str:
    if args.action != "list":
        return "reward services now: " + ", ".join(body["addresses"])
    rows = [
        f"  {w['address']:<22} {w['health']:<12} {', '.join(w['functions'] or []) or '-'}"
        for w in body["rewards"]
    ]
    source = "the run's list in Redis" if body["source"] == "redis" else "the config's"
    return "\n".join([f"reward services ({source}):", *rows])


def show_queues(args: argparse.Namespace, body: dict[str, Any]) -> str:
    lines = []
    for name, q in body.items():
        counts = f"length {q['length']:>7}"
        if "pending" in q:
            counts += f"  pending {q['pending']:>7}  unread {q['unread']:>7}"
        lines.append(f"{name.replace('_', ' '):<13} {counts}")
    return "\n".join(lines)


def show_dead_letters(args: argparse.Namespace, body: dict[str, Any]) -> str:
    if args.action == "replay":
        return f"{body['id']} replayed onto {body['stream']} as {body['new_entry_id']}"
    rows = [
        f"{d['id']:<24} {d['queue']:<13} {d['deliveries']} deliveries  {d['payload_bytes']} B  {d['reason']}"
        for d in body["dead_letters"]
    ]
    return "\n".join(rows) or "no dead letters"


def show_audit(args: argparse.Namespace, body: dict[str, Any]) -> str:
    return (
        "\n".join(
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['time']))} {e['who']:<24} {e['source']:<7} "
            f"{e['action']} {e['target']}: {json.dumps(e['old'])} -> {json.dumps(e['new'])}"
            + (f"  ({e['detail']})" if e.get("detail") else "")
            for e in body["entries"]
        )
        or "no entries"
    )


SHOW: dict[str, Show] = {
    "status": show_status,
    "metrics": show_rows,
    "validation": show_rows,
    "config": show_config,
    "pause": show_action,
    "resume": show_action,
    "stop": show_action,
    "checkpoint": show_checkpoint,
    "hparams": show_hparams,
    "set": show_set,
    "replicas": show_replicas,
    "rewards": show_rewards,
    "autoscale": show_autoscale,
    "queues": show_queues,
    "dead-letters": show_dead_letters,
    "audit": show_audit,
}


def show(args: argparse.Namespace, body: Any) -> str:
    """A person's view of an answer: lines and tables (JSON for an answer of a shape not known)."""
    try:
        return SHOW[args.cmd](args, body)
    except (KeyError, TypeError, ValueError, AttributeError):  # a newer plane's answer: as it is
        return json.dumps(body, indent=2)


def problem_text(problem: Any) -> str:
    """One problem of a refusal in words: the field, what is wrong, a live hyper-parameter's range.
    ``problem``: the plane's own message, or one entry of a 422's list (FastAPI's validation)."""
    if isinstance(problem, str):
        return problem
    if not isinstance(problem, dict):
        return json.dumps(problem)
    where = [str(p) for p in problem.get("loc", []) if p not in ("body", "query", "path")]
    name = ".".join(where) or "the request"
    h = HPARAMS.get(where[-1]) if where else None
    value = problem.get("input")
    if h is not None and isinstance(value, int | float) and not isinstance(value, bool):
        return f"{name}: {value:g} is outside {range_text(h)}, the range of {h.what} ({h.key})"
    text = f"{name}: {problem.get('msg', 'refused')}"
    if problem.get("type") != "missing" and isinstance(value, str | int | float):
        text += f" (got {json.dumps(value)})"
    return text + (f"; allowed: {range_text(h)}" if h is not None else "")


def refusal(cmd: str, status: int, body: Any) -> list[str]:
    """The plane's refusal as lines for stderr, one per problem, each naming the field."""
    if status == 401:
        return [f"rlmesh ctl {cmd}: the control plane wants the run's token (HTTP 401): {TOKEN_HINT}"]
    detail = body.get("detail", body.get("message", body)) if isinstance(body, dict) else body
    problems = detail if isinstance(detail, list) and detail else [detail]
    return [f"rlmesh ctl {cmd}: {problem_text(p)} (HTTP {status})" for p in problems]


def unreachable(target: Target, error: httpx.HTTPError) -> str:
    """Why a request got no answer, with the URL tried and where that URL came from."""
    if not isinstance(error, httpx.ConnectError):
        return f"rlmesh ctl: {target.url} (from {target.source}): {type(error).__name__}: {error}"
    if target.searched:
        return (
            f"rlmesh ctl: no running job found ({target.searched}), and nothing answers at {target.url} "
            f"({target.source}): {error}"
        )
    return f"rlmesh ctl: nothing answers at {target.url} (from {target.source}): {error}"


def main(argv: Sequence[str] | None = None) -> int:
    rest, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(rest)
    method, path, kw = request_for(args)  # a usage error before anything is looked up

    def note(msg: str) -> None:
        print(f"rlmesh ctl: {msg}", file=sys.stderr)

    try:
        target = find_target(args.url, args.config, overrides, args.run, note)
    except ConfigError as e:
        print(f"rlmesh ctl: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    headers = {"X-Rlmesh-User": f"{getpass.getuser()}@{socket.gethostname()}"}
    if target.token:
        headers["Authorization"] = f"Bearer {target.token}"
    timeout = 3600.0 if args.cmd in ("checkpoint", "replicas") else args.timeout
    try:
        https = target.url.startswith("https:")
        verify = client_ssl_context(target.tls) if https and target.tls else True
        resp = httpx.request(
            method, f"{target.url}{API}{path}", headers=headers, timeout=timeout, verify=verify, **kw
        )
    except httpx.HTTPError as e:
        print(unreachable(target, e), file=sys.stderr)
        return 1
    try:
        body = resp.json()
    except ValueError:
        body = {"detail": resp.text}
    if resp.status_code >= 400:
        print("\n".join(refusal(args.cmd, resp.status_code, body)), file=sys.stderr)
        return 1
    try:
        print(json.dumps(body, indent=2) if args.json else show(args, body))
    except BrokenPipeError:  # `rlmesh ctl metrics | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0
