"""A rollout fleet under a load the caller sets, sized by the autoscaler: a private Redis, the real
reward service, the real control plane with rlmesh.control.autoscale on, replicas on simulated
engines (real processes from one fork server) started and stopped by ``rlmesh train``'s own
actuator (``LocalFleet``), and in this process a producer putting prompt tasks on the run's stream
at the phase's rate and a consumer reading every trajectory as the learner's group. The audit:
every task put came back as exactly its ``n`` samples, once each, and nothing was dead-lettered.
Used by tests/integration/control/test_autoscale.py and ``make bench-autoscale``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlmesh.data import ARITHMETIC_DATA_SOURCE
from rlmesh.engine.simulated import SimulationSpec, write_simulated_model
from rlmesh.job.local_fleet import LocalFleet
from rlmesh.job.stack import free_port_overrides, start_stack
from rlmesh.models import build_tokenizer
from rlmesh.queue import RunKeys, connect, prompt_queue, trajectory_queue
from rlmesh.queue.fleet_target import decode_fleet_target, fleet_target_key
from rlmesh.runtime.launcher import ProcessLauncher, start_fork_server
from rlmesh.v1 import common_pb2, trajectory_pb2
from tests.support.repo import CPU_DEMO

TOKEN = "autoscale-test-token"
# A task ends with the longest of its 4 samples, about 16 tokens at 10 tokens/s: with two slots a
# replica finishes about 1.2 tasks a second.
AUTOSCALE_SPEC = SimulationSpec(
    vocab_size=100,
    eos_token_id=96,
    tokens_per_s=10.0,
    length_median=12,
    length_sigma=0.3,
    length_max=24,
    weight_bytes=1 << 16,
)
N = 4  # samples a task (the demo config's rollout.n)


@dataclass(frozen=True)
class Phase:
    """``tasks_per_s`` put for ``seconds``, or, with ``until``, until it has held for ``hold_s``
    on end (``deadline_s`` at most: then the phase fails naming ``what``)."""

    name: str
    tasks_per_s: float
    seconds: float = 0.0
    until: Callable[[Sample], bool] | None = None
    what: str = ""
    deadline_s: float = 180.0
    hold_s: float = 0.0


@dataclass(frozen=True)
class Sample:
    """The fleet at one instant of the drive."""

    t: float  # seconds since the drive started
    phase: str
    replicas: int  # replicas running here
    settled: bool  # no replica being started or stopped
    desired: int | None  # the autoscaler's last target
    put: int
    done: int  # tasks whose n samples all came back

    @property
    def outstanding(self) -> int:
        return self.put - self.done


@dataclass
class DriveResult:
    samples: list[Sample] = field(default_factory=list)
    phase_start: dict[str, float] = field(default_factory=dict)
    put: list[str] = field(default_factory=list)  # group uids, in the order put
    samples_of: Counter[str] = field(default_factory=Counter)  # trajectory uid -> times read
    unknown: list[str] = field(default_factory=list)  # trajectories of groups never put
    dead_letters: int = 0

    def follow_s(self, phase: str, reached: Callable[[Sample], bool]) -> float | None:
        """Seconds from ``phase``'s start to the first sample in it where ``reached`` holds."""
        t0 = self.phase_start[phase]
        for s in self.samples:
            if s.phase == phase and reached(s):
                return s.t - t0
        return None

    def audit(self, n: int = N) -> list[str]:
        """What breaks exactly-once: each task put back as its n samples, each read once."""
        problems = []
        for group in self.put:
            missing = [i for i in range(n) if self.samples_of.get(f"{group}/{i}", 0) == 0]
            if missing:
                problems.append(f"group {group}: samples {missing} never came back")
        twice = sorted(u for u, k in self.samples_of.items() if k > 1)
        if twice:
            problems.append(f"trajectories read twice: {twice[:5]} ({len(twice)} in all)")
        if self.unknown:
            problems.append(f"trajectories of groups never put: {self.unknown[:5]}")
        if self.dead_letters:
            problems.append(f"{self.dead_letters} entries dead-lettered")
        return problems


def autoscale_keys(
    *,
    min_replicas: int,
    max_replicas: int,
    poll_s: float = 1.0,
    rate_window_s: float = 5.0,
    up_cooldown_s: float = 5.0,
    down_cooldown_s: float = 10.0,
    down_window_s: float = 10.0,
) -> list[str]:
    section = "rlmesh.control.autoscale"
    return [
        f"{section}.enabled=true",
        f"{section}.min_replicas={min_replicas}",
        f"{section}.max_replicas={max_replicas}",
        f"{section}.poll_s={poll_s}",
        f"{section}.rate_window_s={rate_window_s}",
        f"{section}.scale_up_cooldown_s={up_cooldown_s}",
        f"{section}.scale_down_cooldown_s={down_cooldown_s}",
        f"{section}.scale_down_window_s={down_window_s}",
    ]


class FleetUnderLoad:
    """The stack of the module docstring, in ``root``; a context manager. ``settings``: the
    rlmesh.control.autoscale keys (``autoscale_keys``'s short cool-downs and windows by default)."""

    def __init__(
        self,
        root: Path,
        spec: SimulationSpec,
        *,
        min_replicas: int = 1,
        max_replicas: int = 4,
        tasks_in_flight: int = 2,
        max_response_length: int = 32,
        settings: list[str] | None = None,
        extra: list[str] | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        self.root, self.say = root, say
        self.run_id = f"autoscale-{uuid.uuid4().hex[:8]}"
        self.keys = RunKeys.signed(self.run_id, TOKEN)
        model = write_simulated_model(root / "sim", spec)
        self.vocab = len(build_tokenizer(model))  # the replicas decode responses with it
        assert self.vocab <= spec.vocab_size, f"the spec's vocab ({spec.vocab_size}) is below the tokenizer's"
        self.overrides = [
            f"rlmesh.run_id={self.run_id}",
            f"rlmesh.auth_token={TOKEN}",
            f"actor_rollout_ref.model.path={model}",
            f"actor_rollout_ref.rollout.n={N}",
            f"data.max_response_length={max_response_length}",
            f"trainer.default_local_dir={root / 'run'}",
            f"rlmesh.rollout.replicas={min_replicas}",
            f"rlmesh.sampler.tasks_in_flight={tasks_in_flight}",
            "rlmesh.queue.heartbeat_ttl_s=3",
            "rlmesh.queue.claim_idle_ms=5000",
            "rlmesh.runtime.shutdown_grace_s=20",
            *(settings or autoscale_keys(min_replicas=min_replicas, max_replicas=max_replicas)),
            *(extra or []),
        ]
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> FleetUnderLoad:
        with contextlib.ExitStack() as stack:
            forkserver = stack.enter_context(start_fork_server())  # type: ignore[arg-type]
            self.launcher = stack.enter_context(
                ProcessLauncher(self.root / "services", stop_grace_s=40, forkserver=forkserver)
            )
            self.stack = start_stack(
                self.launcher, str(CPU_DEMO), self.overrides, services=("reward", "rollout"), say=self.say
            )
            self.control = self.launcher.start_service(
                "control",
                config_path=CPU_DEMO,
                # No learner: the autoscaler needs none, and nothing here asks the plane for one.
                overrides=[
                    *self.stack.overrides,
                    *free_port_overrides("control"),
                    "rlmesh.learner.addresses=['127.0.0.1:9']",
                ],
                timeout_s=120,
            )
            self.fleet = LocalFleet(self.stack, self.keys, self.say, poll_s=0.5)
            stack.callback(self.fleet.close)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stack is not None
        self.fleet.close()
        self.stack.stop()
        self._stack.close()

    def task(self, index: int, phase: str) -> trajectory_pb2.PromptTask:
        group = f"i1:s0:d{index}:{phase}-{uuid.uuid4().hex[:6]}"
        return trajectory_pb2.PromptTask(
            uid=group,
            group_uid=group,
            n=N,
            prompt_ids=[(index + k) % (self.vocab - 1) + 1 for k in range(8)],
            prompt_text=f"task {index}",
            ground_truth="0",
            data_source=ARITHMETIC_DATA_SOURCE,
            sampling_params=common_pb2.SamplingParams(temperature=1.0),
            step=0,
            enqueued_unix_ms=int(time.time() * 1000),
        )

    def drive(self, phases: list[Phase], every_s: float = 0.5) -> DriveResult:
        """Runs the phases in order; a sample of the fleet every ``every_s``."""
        return asyncio.run(self._drive(phases, every_s))

    async def _drive(self, phases: list[Phase], every_s: float) -> DriveResult:
        redis = connect(self.stack.redis_url)
        prompts = prompt_queue(redis, self.keys, "producer")
        trajectories = trajectory_queue(redis, self.keys, "audit")
        await prompts.ensure_group()
        await trajectories.ensure_group()
        result = DriveResult()
        put_at: set[str] = set()
        complete: Counter[str] = Counter()
        stop = asyncio.Event()

        async def consume() -> None:
            while not stop.is_set():
                for d in await trajectories.claim(64, block_ms=200):
                    t = d.message
                    result.samples_of[t.uid] += 1
                    if t.group_uid not in put_at:
                        result.unknown.append(t.uid)
                    elif result.samples_of[t.uid] == 1:
                        complete[t.group_uid] += 1
                    await trajectories.ack([d.entry_id])

        consumer = asyncio.create_task(consume())
        t0 = time.monotonic()
        index = 0
        try:
            for phase in phases:
                start = time.monotonic()
                result.phase_start[phase.name] = start - t0
                self.say(f"[autoscale] phase {phase.name}: {phase.tasks_per_s:g} tasks/s")
                owed = 0.0
                held_since: float | None = None
                while True:
                    now = time.monotonic()
                    owed += phase.tasks_per_s * every_s
                    batch = [self.task(index + i, phase.name) for i in range(int(owed))]
                    if batch:
                        await prompts.put(batch)
                        index += len(batch)
                        owed -= len(batch)
                        for task in batch:
                            put_at.add(task.group_uid)
                            result.put.append(task.group_uid)
                    target = decode_fleet_target(self.keys, await redis.get(fleet_target_key(self.keys)))
                    sample = Sample(
                        t=now - t0,
                        phase=phase.name,
                        replicas=len(self.stack.rollouts),
                        settled=not self.fleet.acting,
                        desired=None if target is None else target.desired,
                        put=len(result.put),
                        done=sum(1 for g in put_at if complete[g] >= N),
                    )
                    result.samples.append(sample)
                    if phase.until is None:
                        if now - start >= phase.seconds:
                            break
                    else:
                        if not phase.until(sample):
                            held_since = None
                        elif held_since is None:
                            held_since = now
                        if held_since is not None and now - held_since >= phase.hold_s:
                            break
                        if now - start > phase.deadline_s:
                            raise AssertionError(
                                f"phase {phase.name}: timed out after {phase.deadline_s:g} s waiting for "
                                f"{phase.what}; last: {sample}"
                            )
                    await asyncio.sleep(max(0.0, every_s - (time.monotonic() - now)))
        finally:
            stop.set()
            await consumer
            result.dead_letters = int(await redis.xlen(self.keys.dead_letters))
            await redis.aclose()
        return result


def control_get(fleet: FleetUnderLoad, path: str) -> Any:
    """GET ``path`` of the control plane's REST API, with the run's token."""
    import urllib.request

    request = urllib.request.Request(
        f"http://{fleet.control.grpc_address}{path}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())
