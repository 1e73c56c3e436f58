"""bench-scale's fleet sweep (``--replicas 1,8,32``): whole rollout replicas on simulated engines
(the real rollout service and embedded engine, the real reward service and control plane, one
Redis: tests/support/autoscale.py's stack with the autoscaler off) at each size, idle and then
saturated with prompt tasks. Per size: start-up time, tasks and trajectories a second, Redis's
commands a second (by command, idle and loaded) and CPU, and the CPU of each kind of process.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from rlmesh.queue import connect
from tests.support.autoscale import AUTOSCALE_SPEC, FleetUnderLoad, Phase

SLOTS = 4  # tasks one replica works on at once
# A task ends with the longest of its 4 samples: about 48 tokens at 20 tokens/s, so a replica of 4
# slots finishes about 1.4 tasks a second.
SPEC = replace(AUTOSCALE_SPEC, tokens_per_s=20.0, length_median=40, length_max=96)
TASK_S = 2.8  # a generous guess at one task's seconds, for the producer's rate


def kind_of(cmdline: list[str]) -> str | None:
    """What a process of the stack is, by its command line: replica, engine, reward, control or
    forkserver (Redis is measured by its own counters); None for anything else."""
    words = cmdline[2:6]
    if "engine" in words:
        return "engine"
    if "serve" in words:
        service = words[words.index("serve") + 1] if words.index("serve") + 1 < len(words) else ""
        return "replica" if service == "rollout" else service
    return "forkserver" if "forkserver" in words else None


def stack_processes() -> list[tuple[str, psutil.Process]]:
    """Every process of the stack (this process's descendants: the fork server forks them all)."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            kind = kind_of(proc.cmdline())
        except psutil.Error:
            continue
        if kind is not None:
            out.append((kind, proc))
    return out


def process_cpu() -> dict[str, float]:
    """CPU seconds so far by kind."""
    out: dict[str, float] = {}
    for kind, proc in stack_processes():
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        out[kind] = out.get(kind, 0.0) + t.user + t.system
    return out


def memory_mb() -> float:
    """The stack's private memory (USS): pages shared with the fork server counted once, not per process."""
    total = 0
    for _, proc in stack_processes():
        try:
            total += proc.memory_full_info().uss
        except psutil.Error:
            continue
    return total / 2**20


async def redis_info(url: str) -> dict[str, float]:
    """Redis's counters: commands (in all and ``cmd:<name>``), CPU seconds, memory, bytes in and out."""
    redis = connect(url)
    try:
        info = await redis.info("all")
    finally:
        await redis.aclose()
    out = {
        "commands": float(info["total_commands_processed"]),
        # The AOF rewrite child's CPU too: it is Redis's work for the run.
        "cpu_s": sum(
            float(info[k])
            for k in ("used_cpu_user", "used_cpu_sys", "used_cpu_user_children", "used_cpu_sys_children")
        ),
        "memory": float(info["used_memory"]),
        "aof_rewrites": float(info.get("aof_rewrites", 0) or 0),
        "net_in": float(info["total_net_input_bytes"]),
        "net_out": float(info["total_net_output_bytes"]),
    }
    for key, value in info.items():
        if key.startswith("cmdstat_") and isinstance(value, dict):
            out[f"cmd:{key.removeprefix('cmdstat_')}"] = float(value["calls"])
    return out


def window(fleet: FleetUnderLoad, run: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``run()`` with the counters of Redis and of every process taken around it."""
    r0, c0, t0 = asyncio.run(redis_info(fleet.stack.redis_url)), process_cpu(), time.monotonic()
    result = run()
    r1, c1, dt = asyncio.run(redis_info(fleet.stack.redis_url)), process_cpu(), time.monotonic() - t0
    commands = {k.removeprefix("cmd:"): (r1[k] - r0.get(k, 0.0)) / dt for k in r1 if k.startswith("cmd:")}
    return result, {
        "seconds": round(dt, 1),
        "redis_commands_per_s": round((r1["commands"] - r0["commands"]) / dt, 1),
        "redis_cpu_share": round((r1["cpu_s"] - r0["cpu_s"]) / dt, 4),
        "redis_mb_in_per_s": round((r1["net_in"] - r0["net_in"]) / dt / 2**20, 3),
        "top_commands_per_s": dict(
            sorted(((k, round(v, 1)) for k, v in commands.items() if v > 0), key=lambda kv: -kv[1])[:6]
        ),
        "cpu_share": {k: round((c1.get(k, 0.0) - c0.get(k, 0.0)) / dt, 4) for k in sorted(c1)},
    }


def fleet_point(
    replicas: int, workdir: Path, idle_s: float, load_s: float, say: Callable[[str], None]
) -> dict[str, Any]:
    """One size: start the fleet, an idle window, a saturated window."""
    with tempfile.TemporaryDirectory(dir=workdir) as root:
        fleet = FleetUnderLoad(
            Path(root),
            SPEC,
            min_replicas=replicas,
            max_replicas=max(replicas, 1),
            tasks_in_flight=SLOTS,
            max_response_length=SPEC.length_max,
            settings=["rlmesh.control.autoscale.enabled=false"],
            say=lambda msg: None,
        )
        t0 = time.monotonic()
        with fleet:
            start_s = time.monotonic() - t0
            say(f"{replicas} replicas up in {start_s:.1f} s; idle for {idle_s:g} s")
            _, idle = window(fleet, lambda: time.sleep(idle_s))
            rate = 1.5 * replicas * SLOTS / TASK_S  # more than the fleet finishes: it is saturated
            say(f"{replicas} replicas: {rate:.1f} tasks/s offered for {load_s:g} s")
            result, loaded = window(fleet, lambda: fleet.drive([Phase("load", rate, seconds=load_s)]))
            done_tasks = result.samples[-1].done
            memory = memory_mb()
    return {
        "replicas": replicas,
        "start_s": round(start_s, 1),
        "memory_mb": round(memory),
        "idle": idle,
        "loaded": loaded,
        "tasks_per_s": round(done_tasks / loaded["seconds"], 2),
        "trajectories_per_s": round(sum(result.samples_of.values()) / loaded["seconds"], 1),
    }


def fleet_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| replicas | start s | tasks/s | traj/s | Redis cmd/s idle | per replica idle | Redis cmd/s loaded | Redis CPU loaded | replicas CPU | engines CPU | reward CPU | control CPU | memory MB |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        idle, loaded = r["idle"], r["loaded"]
        cpu = loaded["cpu_share"]
        lines.append(
            f"| {r['replicas']} | {r['start_s']} | {r['tasks_per_s']} | {r['trajectories_per_s']} | "
            f"{idle['redis_commands_per_s']} | {idle['redis_commands_per_s'] / r['replicas']:.1f} | "
            f"{loaded['redis_commands_per_s']} | {loaded['redis_cpu_share']:.1%} | {cpu.get('replica', 0):.1%} | "
            f"{cpu.get('engine', 0):.1%} | {cpu.get('reward', 0):.1%} | {cpu.get('control', 0):.1%} | {r['memory_mb']} |"
        )
    return "\n".join(lines)


def plot_scale(records: list[dict[str, Any]], out: Path) -> Path:
    """One figure of bench-scale's results (from one or more results.json): a step's trajectories
    (publish, collect, finish against the stream's MB), the warm push (seconds against the GB moved,
    by engine count) and the fleet (Redis commands a second against replicas, idle and loaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for r in records for p in r.get("points", [])]
    pushes = [p for r in records for p in r.get("pushes", [])]
    fleets = [f for r in records for f in r.get("fleets", [])]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    points.sort(key=lambda p: p["stream_bytes"])
    mb = [p["stream_bytes"] / 1e6 for p in points]
    for key, label in (
        ("publish_s", "publish (8 producers)"),
        ("collect_s", "collect + validate + write rows"),
        ("finish_s", "finish the batch"),
        ("build_s", "pad (before rows were written as groups came)"),
    ):
        have = [(x, p[key]) for x, p in zip(mb, points, strict=True) if key in p]
        if have:
            ax.plot(*zip(*have, strict=True), "o-", label=label)
    ax.set(
        xlabel="one step's trajectories (MB in the stream)",
        ylabel="seconds",
        title="A step through one Redis",
    )
    ax.legend()
    ax = axes[1]
    for engines in sorted({p["engines"] for p in pushes}):
        row = sorted((p for p in pushes if p["engines"] == engines), key=lambda p: p["bytes_moved"])
        ax.plot(
            [p["bytes_moved"] / 1e9 for p in row],
            [p["push_s"] for p in row],
            "o-",
            label=f"{engines} engines",
        )
    ax.set(
        xlabel="GB moved by one push (engines x weights)",
        ylabel="seconds (warm)",
        title="A weight push, fanned out",
    )
    if pushes:
        ax.legend()
    ax = axes[2]
    fleets.sort(key=lambda f: f["replicas"])
    replicas = [f["replicas"] for f in fleets]
    ax.plot(replicas, [f["idle"]["redis_commands_per_s"] for f in fleets], "o-", label="idle")
    ax.plot(replicas, [f["loaded"]["redis_commands_per_s"] for f in fleets], "o-", label="saturated")
    ax.set(xlabel="replicas", ylabel="Redis commands / s", title="A fleet of whole replicas")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
