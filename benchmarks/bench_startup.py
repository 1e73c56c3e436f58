"""make bench-startup: how long the demo's job takes to start and to stop, and where that time goes.

Runs ``rlmesh train -c <the demo's config>`` as a user does, with the overrides ``rlmesh demo``
passes, on the demo's model shape (a random-init tiny Qwen2 with the demo's tokenizer: the warm-up
changes weights, not start-up) and the demo's data, for a few steps, once per seed, one after the
other. For each run it prints:

- launch to first step: from the command's start to the end of the learner's first step (its
  metrics row), and last step to exit: from the end of the last step to the command's exit;
- the phases: when each process started and exited (every descendant of the command, watched in
  /proc), when each service served (its log), the learner's own milestones (its log and metrics),
  the job's lines as they were printed.

    python benchmarks/bench_startup.py [--seeds 0 1] [--steps 3] [--workdir runs/bench-startup] [-v]
        [--tree DIR] [rlmesh demo's flags, e.g. --replicas 1] [key=value ...]

Not a test: the times are read, not asserted; they depend on the machine and its load (run it on
an idle one). ``--tree DIR`` measures another tree of the repository (an older commit) with the
same script, for a before/after on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from rlmesh.job.demo import DEMO_CONFIG, DEMO_WORDS, Prepared, build_parser, run_overrides

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
REDIS_TIME = re.compile(r"^\d+:[A-Z] (\d\d \w{3} \d{4} \d\d:\d\d:\d\d\.\d{3}) ")
# What each service's log says when it is up, and the learner's milestones before its first step.
MILESTONES = [
    ("serving", "rlmesh.runtime: serving"),
    ("serving", "rlmesh.control: control plane ready"),
    ("engine spawned", "started rollout-"),
    ("imports done", "torch thread(s)"),
    ("model + DeepSpeed ready", "colocated reference on rank 0"),
    ("waits for replicas", "waiting for rollout replicas"),
    ("validation done", "validation after step 0"),
    ("stopping", "rlmesh.runtime: stopping"),
    ("stopped", "rlmesh.runtime: stopped"),
    ("stopped", "rlmesh.control: control plane stopped"),
]


@dataclass
class Process:
    pid: int
    name: str
    started: float
    exited: float | None = None


@dataclass
class Watch:
    """Every descendant of one process: when it was first and last seen in /proc."""

    root: int
    every_s: float = 0.02
    seen: dict[int, Process] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.time()
            alive = set(self._descendants(self.root))
            for pid in alive - self.seen.keys():
                self.seen[pid] = Process(pid, _name(pid), now)
            for pid in alive:  # caught between fork and exec: named once it runs its program
                if self.seen[pid].name.startswith("?"):
                    self.seen[pid].name = _name(pid)
            for pid, proc in self.seen.items():
                if proc.exited is None and pid not in alive:
                    proc.exited = now
            time.sleep(self.every_s)

    def _descendants(self, pid: int) -> list[int]:
        found = []
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            return found
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                if _state(child) not in ("Z", "X", ""):
                    found += [child, *self._descendants(child)]
        return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _name(pid: int) -> str:
    """What a process is, from its command line: the service, the engine, redis, the export."""
    try:
        # A forked service's title is one string (setproctitle), an exec'd one's NUL-separated.
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
    except OSError:
        return "?"
    if "forkserver" in argv:
        return "fork server"
    command = (
        argv[argv.index("rlmesh.cli") + 1 : argv.index("rlmesh.cli") + 3] if "rlmesh.cli" in argv else []
    )
    if command[:1] == ["serve"] and len(command) == 2:
        replica = next((a.split("=", 1)[1] for a in argv if a.startswith("rlmesh.sampler.replica_id=")), None)
        return replica or command[1]
    if command[:1] in (["engine"], ["export"]):
        return command[0]
    if any(a.endswith("redis-server") for a in argv):
        return "redis"
    return "? " + " ".join(argv)[:40]  # not yet its own program, or none of the job's


def log_times(path: Path) -> dict[str, float]:
    """The first time each milestone appears in a service's text log (Unix time)."""
    found: dict[str, float] = {}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return found
    for line in lines:
        m = LOG_TIME.match(line)
        if not m:
            continue
        at = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for name, text in MILESTONES:
            if text in line and name not in found:
                found[name] = at
    return found


def redis_exit(path: Path) -> float | None:
    for line in reversed(path.read_text(errors="replace").splitlines() if path.exists() else []):
        m = REDIS_TIME.match(line)
        if m and "ready to exit" in line:
            return datetime.strptime(m[1], "%d %b %Y %H:%M:%S.%f").timestamp()
    return None


def prepare(workdir: Path, seed: int, demo: argparse.Namespace) -> Prepared:
    """The demo's model shape and data, without its warm-up (minutes, and weights only)."""
    from rlmesh.data import generate_arithmetic
    from rlmesh.models import build_tiny_model, build_tokenizer

    root = workdir / f"seed-{seed}"
    model, data = root / "model", root / "data"
    if not (model / "config.json").exists():
        build_tiny_model(
            model,
            build_tokenizer(words=DEMO_WORDS),
            hidden_size=demo.hidden_size,
            num_layers=demo.num_layers,
            num_heads=4,
            num_kv_heads=2,
            seed=seed,
        )
    if not (data / "test.parquet").exists():
        generate_arithmetic(
            data,
            seed,
            train_size=demo.train_size,
            val_size=demo.val_size,
            dev_size=demo.dev_size,
            min_terms=2,
            max_terms=2,
            max_operand=demo.max_operand,
            ops=demo.ops,
        )
    return Prepared(
        model, model, data / "train.parquet", data / "dev.parquet", data / "test.parquet", {}, 0.0
    )


def run_once(workdir: Path, config: Path, seed: int, steps: int, extra: list[str], verbose: bool) -> dict:
    demo = build_parser().parse_args(["--seed", str(seed), "--steps", str(steps), *extra])
    prepared = prepare(workdir, seed, demo)
    run_id = f"bench-startup-{seed}-{uuid.uuid4().hex[:6]}"
    run_dir = workdir / run_id
    overrides = run_overrides(demo, prepared, run_dir, run_id)
    argv = [sys.executable, "-m", "rlmesh.cli", "train", "-c", str(config), *overrides]
    lines: list[tuple[float, str]] = []
    launched = time.time()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    watch = Watch(proc.pid)
    watcher = threading.Thread(target=watch.run, daemon=True)
    watcher.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.time(), line.rstrip("\n")))
        if verbose:
            print(f"  {lines[-1][0] - launched:7.2f}  {line}", end="", flush=True)
    code = proc.wait()
    exited = time.time()
    watch.stop.set()
    watcher.join()
    if code != 0:
        tail = "\n".join(text for _, text in lines[-30:])
        raise SystemExit(f"seed {seed}: rlmesh train exited with code {code}:\n{tail}")

    rows = [json.loads(ln) for ln in (run_dir / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "timing_s/step" in r]
    first_done = trained[0]["timing_start/step"] + trained[0]["timing_s/step"]
    last_done = trained[-1]["timing_start/step"] + trained[-1]["timing_s/step"]
    logs = run_dir / "checkpoints" / "services" / run_id / "logs"
    phases: list[tuple[float, str]] = []
    for t, text in lines:
        if text.startswith("[demo]") or text.startswith("[train]"):
            phases.append((t, f"printed: {text.split('] ', 1)[1][:70]}"))
    for p in watch.seen.values():
        if p.name.startswith("?"):
            continue
        phases.append((p.started, f"{p.name}: process started"))
        if p.exited is not None:
            phases.append((p.exited, f"{p.name}: process exited"))
    for log in sorted(logs.glob("*.log")):
        if log.stem == "redis":
            at = redis_exit(log)
            if at:
                phases.append((at, "redis: ready to exit"))
            continue
        for name, at in log_times(log).items():
            phases.append((at, f"{log.stem}: {name}"))
    phases.append((first_done, "learner: step 1 done"))
    phases.append((last_done, f"learner: step {int(trained[-1]['step'])} done (the last)"))
    phases.append((exited, "rlmesh train exited"))
    phases.sort()
    return {
        "seed": seed,
        "launch_to_first_step_s": first_done - launched,
        "last_step_to_exit_s": exited - last_done,
        "launched": launched,
        "phases": phases,
    }


def show(result: dict) -> None:
    print(
        f"\nseed {result['seed']}: launch to first step {result['launch_to_first_step_s']:.1f} s, "
        f"last step to exit {result['last_step_to_exit_s']:.1f} s"
    )
    for t, what in result["phases"]:
        print(f"  {t - result['launched']:7.2f} s  {what}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=3, help="PPO steps per run")
    parser.add_argument("--workdir", default="runs/bench-startup")
    parser.add_argument("-v", "--verbose", action="store_true", help="echo each run's output as it comes")
    parser.add_argument(
        "--tree",
        default=None,
        help="another tree of the repository to measure (e.g. `git archive <commit> | tar -x -C DIR`): "
        "its libs/ and its services/ (as rlmesh_services) go first on PYTHONPATH, ahead of this "
        "checkout's editable install",
    )
    args, extra = parser.parse_known_args()
    workdir = Path(args.workdir).resolve()
    config = DEMO_CONFIG
    if args.tree:
        # Its packages ahead of this checkout's editable install (which Python consults last).
        tree = Path(args.tree).resolve()
        services = workdir / "tree-packages"
        services.mkdir(parents=True, exist_ok=True)
        link = services / "rlmesh_services"
        link.unlink(missing_ok=True)
        link.symlink_to(tree / "services", target_is_directory=True)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(tree / "libs"), str(services)])
        config = tree / DEMO_CONFIG.relative_to(Path(__file__).resolve().parents[1])
    results = []
    for seed in args.seeds:
        result = run_once(workdir, config, seed, args.steps, list(extra), args.verbose)
        show(result)
        results.append(result)
    print()
    print("| seed | launch to first step | last step to exit |")
    print("|---|---|---|")
    for r in results:
        print(f"| {r['seed']} | {r['launch_to_first_step_s']:.1f} s | {r['last_step_to_exit_s']:.1f} s |")
    summary = {
        "launch_to_first_step_s": [round(r["launch_to_first_step_s"], 1) for r in results],
        "last_step_to_exit_s": [round(r["last_step_to_exit_s"], 1) for r in results],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
