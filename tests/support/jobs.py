"""The chaos tests' jobs: a small job's files and settings, ``rlmesh train`` as a subprocess
whose output a test waits on, and the audit of what the learner trained on.

The audit reads the learner's own record (``trained_groups.jsonl``: the groups, dataset indices and
prompt digests of every committed step, by learner incarnation) and compares it with the plan the
data cursor makes from the seed, a failover's rolled-back steps included. The
recovery settings are scaled down (claims reclaimed after 3 s, heartbeats expiring after 3 s, an
engine given up after 4 s) so a failure is over in seconds.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple
from urllib.parse import quote

import redis as redis_sync

from rlmesh.config import load_config
from rlmesh.data import PromptCursor, RLHFDataset, generate_arithmetic
from rlmesh.learner.run.feeder import index_of
from rlmesh.models import build_tiny_model, build_tokenizer, load_tokenizer
from rlmesh.queue import ROLLOUT_GROUP, RunKeys
from rlmesh.queue.partials import PartialSample, PartialStore
from rlmesh.queue.signing import unwrap
from rlmesh.queue.streams import PAYLOAD
from rlmesh.runtime.forkserver import ForkServer
from rlmesh.v1 import trajectory_pb2
from tests.support.polling import wait_until
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
    """The embedded engine process a replica started: its child, or, where the job's fork server
    (the replica's parent) forked both, the server's child the replica asked for."""

    def argv(pid: int) -> list[bytes]:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()

    parent = int(Path(f"/proc/{replica_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    if argv(parent)[-3:-1] == [b"rlmesh.cli", b"forkserver"]:
        server = ForkServer(argv(parent)[-1].decode())
        children = [c for c, launcher in server.children().items() if launcher == replica_pid]
    else:
        children = []
        for task in Path(f"/proc/{replica_pid}/task").iterdir():
            children += [int(p) for p in (task / "children").read_text().split()]
    engines = [p for p in children if b"engine" in argv(p)]
    assert len(engines) == 1, f"engine children of {replica_pid}: {engines} of {children}"
    return engines[0]


class Planned(NamedTuple):
    """A planned prompt: its dataset row and the digest of its token ids."""

    index: int
    digest: str


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    """What the learner records per group (``prompt_digests``): the prompt ids it trained on, hashed."""
    return hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()[:16]


def plan_of(dataset: RLHFDataset, cursor: PromptCursor, batch: int, steps: int) -> dict[int, list[Planned]]:
    """Every step's prompts as the learner's seeded cursor draws them, each row tokenized as the
    learner's dataset tokenizes it."""
    return {
        s: [
            Planned(dataset[i].index, prompt_digest(dataset[i].prompt_ids))
            for i in cursor.next_indices(batch)
        ]
        for s in range(1, steps + 1)
    }


def planned_prompts(files: Files, run_dir: Path, steps: int) -> dict[int, list[Planned]]:
    """The plan of a job of ``overrides``."""
    cfg = load_config(str(CPU_DEMO), overrides(files, run_dir, steps))
    dataset = RLHFDataset.from_config(cfg.data, load_tokenizer(files.model), split="train")
    return plan_of(dataset, PromptCursor.from_config(cfg.data, dataset), BATCH, steps)


def audit(files: Files, run_dir: Path, steps: int) -> None:
    """Every planned step committed once with exactly its planned prompts, each group with all its
    samples, and no group trained on twice."""
    audit_groups(run_dir / "trained_groups.jsonl", planned_prompts(files, run_dir, steps), N)


def audit_groups(groups_path: Path, plan: dict[int, list[Planned]], n: int) -> None:
    """``audit`` for any run: ``plan`` maps each step to its prompts. Every record must hold its
    step's planned prompts, each group ``n`` samples of its own dataset row; a failover's redone
    steps must each be the one record of their step still standing (``standing_records``)."""
    rows = [json.loads(line) for line in groups_path.read_text().splitlines()]
    for row in rows:
        check_record(row, plan, n)
    standing = standing_records(rows)
    assert sorted(standing) == sorted(plan), f"steps trained {sorted(standing)} != planned {sorted(plan)}"
    groups = [g for row in standing.values() for g in row["groups"]]
    twice = sorted(g for g, k in Counter(groups).items() if k > 1)
    steps_of = {g: [s for s, row in sorted(standing.items()) if g in row["groups"]] for g in twice}
    assert not twice, f"groups trained on in two steps: {steps_of}"


def check_record(row: dict[str, Any], plan: dict[int, list[Planned]], n: int) -> None:
    """One record of ``trained_groups.jsonl``, whether it stands or was rolled back: its step's
    planned prompts, ``n`` samples a group, and each group's prompt ids its dataset row's."""
    step, where = row["step"], f"step {row['step']} (incarnation {row['incarnation']})"
    assert step in plan, f"{where} was recorded but not planned (planned: 1..{max(plan, default=0)})"
    planned = plan[step]
    assert all(isinstance(p, Planned) for p in planned), f"the plan of step {step} has no prompt digests"
    assert Counter(row["prompts"]) == Counter(p.index for p in planned), (
        f"{where} trained on prompts {sorted(row['prompts'])}, planned {sorted(p.index for p in planned)}"
    )
    samples = list(row["groups"].values())
    assert samples == [n] * len(planned), f"{where}: samples per group {row['groups']}, not {n} each"
    # Fails loudly on a record of a learner older than the field: test runs write fresh files.
    assert "prompt_digests" in row, f"{where}: no prompt_digests (a learner older than this audit)"
    digest_of = {p.index: p.digest for p in planned}
    assert sorted(row["prompt_digests"]) == sorted(row["groups"]), f"{where}: digests of other groups"
    for group, digest in row["prompt_digests"].items():
        expected = digest_of.get(index_of(group))
        assert digest == expected, (
            f"{where}: group {group} trained on prompt ids {digest}, not dataset row {index_of(group)}'s {expected}"
        )


def standing_records(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Step -> the record that stands, from the records in the order the learners wrote them.

    A learner records step s before it checkpoints s, and one resumed from the checkpoint of step c
    records c+1, c+2, ... So each learner records consecutive steps, and its first, f, says it
    resumed from the checkpoint of f-1: f-1 stands (or f is 1: a fresh start), and every step >= f
    that earlier learners recorded was rolled back and must be recorded again, by it or a later one.
    A new learner shows as a new incarnation number, or as the same number at a step not above the
    last (a job started again counts from 1 again: its incarnations are its Redis's)."""
    standing: dict[int, dict[str, Any]] = {}
    rolled_back: dict[int, str] = {}  # step -> why it must be recorded again
    previous: dict[str, Any] | None = None
    for row in rows:
        step, incarnation = row["step"], row["incarnation"]
        same_learner = (
            previous is not None and incarnation == previous["incarnation"] and step > previous["step"]
        )
        if same_learner:
            assert previous is not None
            assert step == previous["step"] + 1, (
                f"step {step}: incarnation {incarnation} recorded it after step {previous['step']} "
                f"(a learner records every step, in order)"
            )
        else:  # a new learner: it resumed from the checkpoint of step - 1
            assert step == 1 or step - 1 in standing, (
                f"step {step}: incarnation {incarnation} began at it, but step {step - 1} (the checkpoint "
                f"it resumed from) stands in no record"
            )
            for gone in [s for s in standing if s >= step]:
                rolled_back[gone] = (
                    f"incarnation {standing[gone]['incarnation']} recorded it, and incarnation {incarnation} "
                    f"resumed at step {step}"
                )
                del standing[gone]
        standing[step] = row
        rolled_back.pop(step, None)
        previous = row
    assert not rolled_back, "rolled back and never recorded again: " + "; ".join(
        f"step {s}: {why}" for s, why in sorted(rolled_back.items())
    )
    return standing


# ----- work in flight: what a kill must be shown to hit -----
def run_id_of(job: Job) -> str:
    return job.wait_for(r"^\[train\] run (\S+): checkpoints", timeout_s=240)[1]


def job_redis_url(job: Job, run_dir: Path) -> str:
    """The URL of the Redis ``job`` started, password included."""
    printed = job.wait_for(r"^\[train\] redis +(redis://\S+)", timeout_s=240)[1]
    return private_redis_url(run_dir / "services" / run_id_of(job), printed)


def pending(redis_url: str, stream: str, group: str, consumer: str | None = None) -> int:
    """Entries of ``stream`` handed to ``group`` (to ``consumer`` of it, if given) and not yet acked."""
    with redis_sync.Redis.from_url(redis_url, decode_responses=True) as client:
        try:
            summary = client.xpending(stream, group)
        except redis_sync.ResponseError:  # NOGROUP: no consumer has read the stream yet
            return 0
    if consumer is None:
        return int(summary["pending"])
    return sum(int(c["pending"]) for c in summary["consumers"] or [] if c["name"] == consumer)


def saved_tokens(redis_url: str, keys: RunKeys, consumer: str) -> int:
    """Tokens saved in Redis (partial rollouts) for the prompt tasks ``consumer`` holds: what a
    ``kill -9`` of it would lose without them."""
    tokens = 0
    with redis_sync.Redis.from_url(redis_url) as client:
        try:
            rows = client.xpending_range(keys.prompts, ROLLOUT_GROUP, "-", "+", 1000, consumername=consumer)
        except redis_sync.ResponseError:  # NOGROUP: nothing claimed yet
            return 0
        for row in rows:
            for _, fields in client.xrange(keys.prompts, row["message_id"], row["message_id"]):
                task = trajectory_pb2.PromptTask.FromString(fields[PAYLOAD])
                for value in client.hvals(PartialStore(client, keys).key(task.uid)):
                    payload = unwrap(None, "", value, "partial_sample")  # the signature, if any, cut off
                    tokens += len(PartialSample.FromString(payload).output_ids)
    return tokens


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` in a Prometheus page whose labels include ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m[1] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m[2])
    return total


def metrics_port(run_dir: Path, run_id: str, service: str) -> int:
    """The metrics port of a service the job started, from its ready file."""
    ready = run_dir / "services" / run_id / f"{service}.ready.json"
    return int(json.loads(ready.read_text())["metrics_port"])


def engine_url(redis_url: str, run_id: str, replica_id: str) -> str:
    """The engine address a replica registered."""
    with redis_sync.Redis.from_url(redis_url) as client:
        value = client.get(RunKeys(run_id).replica(replica_id))
    assert value, f"{replica_id} is not registered"
    return trajectory_pb2.ReplicaRegistration.FromString(value).engine_url


def wait_for_work(read: Callable[[], float], what: str, timeout_s: float = RECOVERY_BOUND_S) -> float:
    """Polls ``read`` (the work a process holds) until it is above 0, and returns it: a kill right
    after hits work in flight (each poll is a round trip: the target may finish it meanwhile)."""
    seen = [0.0]

    def has_work() -> bool:
        seen[0] = read()
        return seen[0] > 0

    wait_until(has_work, timeout_s, what)
    return seen[0]


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
