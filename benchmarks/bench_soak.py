"""make bench-soak: the demo pipeline for 1,000 PPO steps with a rollout replica killed (kill -9)
every 100 steps, alternating replicas, each restarted by the job's supervisor. Every 100 steps it
samples the resident memory of every process of the job, Redis's memory and keys, and the disk
the run uses; at the end it prints the table docs/reliability.md quotes (growth from step 100 to the end,
scaled to 1,000 steps) and exits 1 if the job failed.

    python benchmarks/bench_soak.py [--steps 1000] [--kill-every 100] [--workdir runs/soak]

Not a test: it takes about 30 minutes here, and what it measures (growth) is read, not asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import redis


class Demo:
    """``rlmesh demo`` as a subprocess; its output echoed and kept."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            print(line, end="", flush=True)
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.lines.append("<eof>")
            self.cond.notify_all()

    def wait_for(self, pattern: str) -> re.Match[str] | None:
        """The first line matching ``pattern``; None once the demo has ended without one."""
        regex = re.compile(pattern)
        with self.cond:
            while True:
                for line in self.lines:
                    if m := regex.search(line):
                        return m
                if self.lines and self.lines[-1] == "<eof>":
                    return None
                self.cond.wait()

    def pid(self, name: str) -> int:
        started = re.compile(rf"\] {re.escape(name)} +\S+ \(pid (\d+)")
        back = re.compile(rf"\] {re.escape(name)} is back \(pid (\d+)\)")
        with self.cond:
            pids = [int(m[1]) for line in self.lines if (m := started.search(line) or back.search(line))]
        return pids[-1]


def process_name(p: psutil.Process) -> str | None:
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return None
    for i, arg in enumerate(cmd):
        if arg == "--ready-file" and i + 1 < len(cmd):
            return Path(cmd[i + 1]).name.removesuffix(".ready.json")
    if cmd and "redis-server" in Path(cmd[0]).name:
        return "redis-server"
    return None


def rss_by_process(root_pid: int) -> dict[str, float]:
    """MiB resident per process of the job (named by its ready file), the demo's own included."""
    root = psutil.Process(root_pid)
    out = {"rlmesh demo": root.memory_info().rss / 2**20}
    for child in root.children(recursive=True):
        name = process_name(child)
        if name is not None:
            with contextlib.suppress(psutil.Error):
                out[name] = child.memory_info().rss / 2**20
    return out


def disk_mib(path: Path) -> dict[str, float]:
    def size(p: Path) -> float:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20 if p.exists() else 0.0

    return {sub.name: size(sub) for sub in sorted(path.iterdir()) if sub.is_dir()} | {"total": size(path)}


def redis_stats(url: str) -> dict[str, float]:
    with redis.Redis.from_url(url) as r:
        info = r.info("memory")
        return {"used_memory_mib": info["used_memory"] / 2**20, "keys": float(r.dbsize())}


def sample(demo: Demo, run_dir: Path, redis_url: str, step: int) -> dict:
    return {
        "step": step,
        "rss": rss_by_process(demo.proc.pid),
        "redis": redis_stats(redis_url),
        "disk": disk_mib(run_dir),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--kill-every", type=int, default=100)
    parser.add_argument("--workdir", default="runs/soak")
    args, extra = parser.parse_known_args()
    demo = Demo(
        [
            sys.executable, "-m", "rlmesh.cli", "demo",
            "--workdir", args.workdir,
            "--steps", str(args.steps),
            "--test-freq", str(args.kill_every),
            *extra,
            # One restart per kill, and each replica is killed about every 200 steps.
            "rlmesh.runtime.max_restarts_per_hour=30",
        ]
    )  # fmt: skip
    run = demo.wait_for(r"\] run \S+: checkpoints and metrics in (\S+), logs in")
    m = demo.wait_for(r"\] redis +(redis://\S+) \(pid")
    if run is None or m is None:
        return 1
    run_dir, redis_url = Path(run[1]).parent, m[1]
    samples, kills, t0 = [], [], time.monotonic()
    try:
        # The last sample is taken once step steps-1 is done: after the last step the learner
        # validates, exports and exits, and its memory would be missing from the table.
        points = [*range(args.kill_every, args.steps, args.kill_every), args.steps - 1]
        for step in points:
            if demo.wait_for(rf"\] step +{step}/{args.steps} ") is None:
                break
            samples.append(sample(demo, run_dir, redis_url, step))
            if step % args.kill_every == 0:
                victim = f"rollout-{(step // args.kill_every - 1) % 2}"
                pid = demo.pid(victim)
                os.kill(pid, signal.SIGKILL)
                kills.append((step, victim, pid))
                print(f"[soak] step {step}: kill -9 {victim} (pid {pid})", flush=True)
        code = demo.proc.wait()
    finally:
        if demo.proc.poll() is None:
            demo.proc.send_signal(signal.SIGINT)
            demo.proc.wait()
    wall = time.monotonic() - t0
    backs = sum(1 for line in demo.lines if " is back (pid " in line)
    print(f"\n[soak] exit code {code}; {len(kills)} kills, {backs} restarts; {wall / 60:.0f} min")
    if len(samples) < 2:
        return 1
    first, last = samples[0], samples[-1]
    scale = 1000 / max(1, last["step"] - first["step"])
    missing = sorted(set(first["rss"]) ^ set(last["rss"]))

    def row(what: str, a: float, b: float, unit: str) -> str:
        return f"| {what} | {a:.1f} {unit} | {b:.1f} {unit} | {(b - a) * scale:+.1f} {unit} |"

    print(f"\n| after step {first['step']} → {last['step']} | start | end | growth per 1,000 steps |")
    print("|---|---|---|---|")
    for name in sorted(set(first["rss"]) | set(last["rss"])):
        if name in first["rss"] and name in last["rss"]:
            print(row(f"RSS {name}", first["rss"][name], last["rss"][name], "MiB"))
    print(
        row("Redis used_memory", first["redis"]["used_memory_mib"], last["redis"]["used_memory_mib"], "MiB")
    )
    print(row("Redis keys", first["redis"]["keys"], last["redis"]["keys"], ""))
    for part in sorted(set(first["disk"]) | set(last["disk"])):
        print(row(f"disk {part}/", first["disk"].get(part, 0.0), last["disk"].get(part, 0.0), "MiB"))
    print("\nRSS (MiB) at steps " + ", ".join(str(x["step"]) for x in samples) + ":")
    for name in ("learner", "reference", "reward", "redis-server", "rlmesh demo"):
        if all(name in x["rss"] for x in samples):
            print(f"  {name}: " + " ".join(f"{x['rss'][name]:.0f}" for x in samples))
    print("\n(replicas killed and restarted: their RSS is a fresh process's at the end)")
    if missing:
        print(f"(not in both samples: {', '.join(missing)})")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
