"""The chaos tests' jobs: a small job's files and settings, ``rlmesh train`` as a subprocess
whose output a test waits on, and the audit of what the learner trained on.

The audit reads the learner's own record (``trained_groups.jsonl``: the groups and dataset indices
of every committed step) and compares it with the plan the data cursor makes from the seed. The
recovery settings are scaled down (claims reclaimed after 3 s, heartbeats expiring after 3 s, an
engine given up after 4 s) so a failure is over in seconds.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar
from urllib.parse import quote

from rlmesh.config import load_config
from rlmesh.data import PromptCursor, RLHFDataset, generate_arithmetic
from rlmesh.models import build_tiny_model, build_tokenizer, load_tokenizer
from tests.support.processes import child_env
from tests.support.repo import CPU_DEMO, REPO

STEPS = 10
# Chaos runs planned longer than their failures take on any machine, stopped by Ctrl-C after them
# (a step of the demo takes 0.1 s on a fast machine: a fixed plan could end before the last one).
LONG_RUN_STEPS = 100_000
KILL_AT = 3  # the kill comes once this step is done (or a later one: lines come per poll)
RECOVERY_BOUND_S = 90  # per failure, with the scaled-down settings below
BATCH, N = 8, 2
# Scaled-down recovery settings: what a test can wait for, not what a week-long run would use.
CHAOS_KEYS = [
    "rlmesh.queue.claim_idle_ms=3000",
    "rlmesh.queue.heartbeat_ttl_s=3",
    "rlmesh.sampler.engine_lost_after_s=4",
    "rlmesh.sampler.breaker_reset_s=0.5",
    "rlmesh.sampler.retry_max_backoff_s=1",
    "rlmesh.runtime.shutdown_grace_s=5",
    "rlmesh.runtime.max_restarts_per_hour=3",
]


@dataclass
class Files:
    model: Path
    train: Path
    val: Path


def private_redis_url(services_dir: Path, printed: str) -> str:
    """The URL of the Redis a job started in ``services_dir``, whose printed form (``printed``)
    masks the password: the password is read back from the server's own 0600 config file."""
    conf = (services_dir / "redis" / "secrets.conf").read_text().splitlines()
    (line,) = [ln for ln in conf if ln.startswith("requirepass ")]
    password = shlex.split(line)[1]
    return printed.replace(":***@", f":{quote(password, safe='')}@", 1)


def make_files(root: Path) -> Files:
    model = build_tiny_model(root / "model", build_tokenizer(), hidden_size=32, num_layers=2, seed=0)
    data = generate_arithmetic(
        root / "data", 0, train_size=96, val_size=8, min_terms=2, max_terms=2, max_operand=20, ops="+"
    )
    return Files(model, data["train"], data["test"])


def overrides(files: Files, run_dir: Path, steps: int) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={files.model}",
        f"data.train_files={files.train}",
        f"data.val_files={files.val}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"data.train_batch_size={BATCH}",
        "data.seed=7",  # the plan the audit compares with is the seeded cursor's
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.response_length=6",
        "algorithm.adv_estimator=grpo",  # no critic: shorter steps, the same pipeline
        "rlmesh.sampler.tasks_in_flight=4",
        *CHAOS_KEYS,
    ]


@dataclass
class Job:
    """``rlmesh train`` as a subprocess, its output read as it comes."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    command: ClassVar[str] = "train"  # the `rlmesh` subcommand a subclass runs instead

    @classmethod
    def start(cls, argv: list[str]) -> Job:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlmesh.cli", cls.command, *argv],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        job = cls(proc)
        threading.Thread(target=job._read, daemon=True).start()
        return job

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.lines.append("<eof>")
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first output line matching ``pattern``; fails naming it (and the output's tail)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                for line in self.lines:
                    if m := regex.search(line):
                        return m
                if self.lines and self.lines[-1] == "<eof>":
                    raise AssertionError(f"the job ended before {pattern!r}:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {pattern!r} within {timeout_s} s:\n{self.tail()}")
                self.cond.wait(left)

    def pid(self, name: str) -> int:
        """The newest pid the job printed for ``name`` (at start, or when it restarted it)."""
        started = re.compile(rf"^\[train\] {re.escape(name)} +\S+ \(pid (\d+)")
        back = re.compile(rf"^\[train\] {re.escape(name)} is back \(pid (\d+)\)")
        with self.cond:
            pids = [int(m[1]) for line in self.lines if (m := started.search(line) or back.search(line))]
        assert pids, f"no pid printed for {name}:\n{self.tail()}"
        return pids[-1]

    def count(self, pattern: str) -> int:
        regex = re.compile(pattern)
        with self.cond:
            return sum(1 for line in self.lines if regex.search(line))

    def wait_for_count(self, pattern: str, count: int, timeout_s: float) -> None:
        """Until ``count`` output lines match ``pattern``."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.count(pattern) < count:
                if self.lines and self.lines[-1] == "<eof>":
                    raise AssertionError(f"the job ended with fewer than {count} {pattern!r}:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"fewer than {count} {pattern!r} within {timeout_s} s:\n{self.tail()}"
                    )
                self.cond.wait(left)

    def last_step(self) -> int:
        """The newest step the job printed a progress line for (0: none yet)."""
        regex = re.compile(r"^\[train\] step +(\d+)/")
        with self.cond:
            return max([int(m[1]) for line in self.lines if (m := regex.search(line))], default=0)

    def finish(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)  # stops every service it started
            self.proc.wait(timeout=60)
            raise AssertionError(f"the job did not finish within {timeout_s} s:\n{self.tail()}") from None

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.lines[-lines:])


def step_line(step: int, steps: int) -> str:
    return rf"^\[train\] step +{step}/{steps} "


def engine_of(replica_pid: int) -> int:
    """The embedded engine process a replica started (its child)."""
    children = []
    for task in Path(f"/proc/{replica_pid}/task").iterdir():
        children += [int(p) for p in (task / "children").read_text().split()]
    engines = [p for p in children if b"engine" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]
    assert len(engines) == 1, f"engine children of {replica_pid}: {engines} of {children}"
    return engines[0]


def planned_prompts(files: Files, run_dir: Path, steps: int) -> dict[int, list[int]]:
    """Dataset indices of every step's prompts, as the learner's data cursor draws them."""
    cfg = load_config(str(CPU_DEMO), overrides(files, run_dir, steps))
    dataset = RLHFDataset.from_config(cfg.data, load_tokenizer(files.model), split="train")
    sampler = PromptCursor.from_config(cfg.data, dataset)
    return {s: [dataset[i].index for i in sampler.next_indices(BATCH)] for s in range(1, steps + 1)}


def audit(files: Files, run_dir: Path, steps: int) -> None:
    """Every planned step committed once with exactly its planned prompts, each group with all its
    samples, and no group trained on twice (a resumed run's redone steps: the last record counts)."""
    audit_groups(run_dir / "trained_groups.jsonl", planned_prompts(files, run_dir, steps), N)


def audit_groups(groups_path: Path, plan: dict[int, list[int]], n: int) -> None:
    """``audit`` for any run: ``plan`` maps each step to its prompts' dataset indices."""
    rows = [json.loads(line) for line in groups_path.read_text().splitlines()]
    last = {row["step"]: row for row in rows}
    assert sorted(last) == sorted(plan), f"steps trained {sorted(last)} != planned {sorted(plan)}"
    for step, row in sorted(last.items()):
        assert Counter(row["prompts"]) == Counter(plan[step]), f"step {step} trained on other prompts"
        samples = list(row["groups"].values())
        assert samples == [n] * len(plan[step]), f"step {step}: samples per group {row['groups']}"
    groups = [g for row in last.values() for g in row["groups"]]
    assert len(set(groups)) == len(groups), "a group was trained on in two steps"


def committed_steps(run_dir: Path) -> int:
    """The last step the learner committed (its ``trained_groups.jsonl``)."""
    rows = (run_dir / "trained_groups.jsonl").read_text().splitlines()
    return max(json.loads(line)["step"] for line in rows)


def stop_and_audit(job: Job, files: Files, run_dir: Path) -> int:
    """Ctrl-C a long job (it stops cleanly: exit 130) and audit every step it committed; returns
    how many. For chaos runs planned longer than their failures take on any machine."""
    job.proc.send_signal(signal.SIGINT)
    assert job.finish(timeout_s=240) == 130, job.tail()
    committed = committed_steps(run_dir)
    audit(files, run_dir, committed)
    return committed


def steps_started_after(run_dir: Path, at: float) -> list[dict[str, float]]:
    """The learner's metrics rows of the steps that started at or after ``at`` (Unix time). The
    job's progress lines lag the learner by a poll: a step printed after a kill may have begun
    before it."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r.get("timing_start/step", 0) >= at]


def recovery_s(run_dir: Path, killed_at: float) -> float:
    """Seconds from the kill until the first step that started after it was done (the learner's
    own timings): how long the failure held the run up, plus one step."""
    after = steps_started_after(run_dir, killed_at)
    assert after, "no step started after the kill"
    return after[0]["timing_start/step"] + after[0]["timing_s/step"] - killed_at
