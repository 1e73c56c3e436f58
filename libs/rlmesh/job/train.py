"""``rlmesh train -c CONFIG [key=value ...]``: a whole PPO job on this machine, the counterpart of
verl's ``main_ppo``. docs/train.md"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlmesh.job.report import engine_server_info, plot, read_metrics, stage_rates
from rlmesh.job.stack import STANDBY
from rlmesh.reward.failures import step_line_part
from rlmesh.runtime.forkserver import ForkServer
from rlmesh.runtime.tls import sync_channel, tls_of

Say = Callable[[str], None]


@dataclass
class JobResult:
    """How a job ended; ``code`` is the process exit code ``rlmesh train`` returns."""

    code: int
    run_id: str
    checkpoint_dir: Path
    service_dir: Path
    wall_s: float
    rows: list[dict[str, float]] = field(default_factory=list)
    engines: list[dict[str, Any]] = field(default_factory=list)
    failure: str = ""
    outputs_written: bool = False  # the plot, and the export when asked for (write_outputs)
    exported: Path | None = None
    export_failure: str = ""
    started_wall: float = 0.0  # time.time() at the start: rows written after it are this run's


def say_with(prefix: str) -> Say:
    def say(msg: str) -> None:
        print(f"[{prefix}] {msg}", flush=True)

    return say


def progress_line(
    step: int,
    total: int,
    m: dict[str, float],
    elapsed_s: float,
    done: int | None = None,
    paused_s: float = 0.0,
) -> str:
    """One step: reward, KL, validation score, throughput, step time, elapsed and remaining time
    (``done``: the steps ``elapsed_s`` covers, fewer than ``step`` in a resumed run; ``paused_s``:
    how much of ``elapsed_s`` the learner was paused, which the remaining time leaves out)."""
    val = f"{m['val/score']:.2f}" if "val/score" in m else "  - "
    # The KL that acts on the policy: the in-reward penalty, else the loss term (use_kl_loss);
    # the learner reports the one that is off as 0.
    kl = m.get("actor/reward_kl_penalty") or m.get("actor/kl_loss", 0.0)
    done = step if done is None else done
    working_s = max(elapsed_s - paused_s, 0.0)
    eta = f", eta {working_s / done * (total - step):.0f} s" if done > 0 and step < total else ""
    paused = f", {paused_s:.0f} s paused" if paused_s >= 1 else ""
    return (
        f"step {step:>3}/{total}  reward {m.get('critic/score/mean', 0):.3f}  "
        f"kl {kl:+.4f}  val {val}  "
        f"tok/s {m.get('training/tokens', 0) / max(m.get('timing_s/step', 0), 1e-9):>6.0f}  {m.get('timing_s/step', 0):.1f} s/step  "
        f"[{elapsed_s:.0f} s{paused}{eta}]{step_line_part(m)}"
    )


# A record of the text log format starts with its time: ``2026-12-03 15:00:51,859 ERROR [...]``.
TEXT_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def learner_failure(log_path: Path) -> str | None:
    """What ended the learner (the exception's type and message), from the last "training failed"
    record of its log, JSON or text (``rlmesh.runtime.log_format``); None when there is none."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if "training failed" not in line:
            continue
        if line.startswith("{"):
            try:
                exc = str(json.loads(line).get("exc") or "")
            except (ValueError, AttributeError):
                continue
        else:  # the traceback follows on the lines up to the next record
            after = itertools.takewhile(lambda ln: not TEXT_RECORD.match(ln), lines[i + 1 :])
            exc = "\n".join(after)
        # The traceback's frames are indented; the exception (its message may span lines) follows.
        tail = exc.rsplit("Traceback (most recent call last):", 1)[-1].splitlines()
        rest = list(itertools.dropwhile(lambda ln: not ln or ln[0].isspace(), tail))
        return "\n".join(rest).strip() or None
    return None


class MetricsFollower:
    """The rows a learner appends to its ``metrics.jsonl`` from now on: rows of earlier runs (a
    resumed run appends to the same file) and a line still being written are left out."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new_rows(self) -> list[dict[str, float]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class RestartBudget:
    """How often each service may be restarted: ``per_hour`` times in any hour."""

    def __init__(self, per_hour: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_hour = per_hour
        self.clock = clock
        self.times: dict[str, list[float]] = {}

    def take(self, name: str) -> int:
        """Counts a restart of ``name``; returns its number within the hour, or 0 when over budget."""
        now = self.clock()
        recent = [t for t in self.times.get(name, []) if now - t < 3600]
        if len(recent) >= self.per_hour:
            return 0
        self.times[name] = [*recent, now]
        return len(recent) + 1


class Supervisor:
    """Restarts every service of ``stack`` that dies, the learner included when it died rather than
    failed (``restartable``: killed, or a rank of it lost) and its run is not over: a new learner
    takes the run's lease, resumes from the latest checkpoint and pushes its weights to the
    replicas, which, like Redis, reward and reference, go on running. A learner that failed by
    itself (an error in its run) is not restarted: the job ends, naming it. Restarts run one at a
    time in a worker thread, so the progress lines and the watch on the other services go on while
    a replica reloads its model. The worker lives as long as the job: a child gets its parent-death
    signal when the thread that spawned it ends."""

    def __init__(self, stack: Any, restarts: RestartBudget, say: Say) -> None:
        self.stack, self.restarts, self.say = stack, restarts, say
        self.restarting: set[str] = set()
        self.gone: set[str] = set()  # services that ended and are not restarted (a standby's exit)
        self.failure = ""
        self.run_over = False  # set once the learner's run ended: its exit is then no death
        self.restarted = threading.Event()  # set as each restarted service is back
        self._todo: queue.Queue[tuple[str, str]] = queue.Queue()
        threading.Thread(target=self._work, daemon=True, name="supervisor").start()

    def check(self) -> str:
        """Queues a restart for each newly dead service; returns why the job must fail instead (a
        service over its restart budget, or one that did not come back healthy), else ""."""
        from rlmesh.runtime.launcher import restartable

        for name, proc in self.stack.processes():
            if proc.alive() or name in self.restarting or name in self.gone or self.failure:
                continue
            code = proc.popen.returncode
            if name == "learner" and (self.run_over or not restartable(code)):
                continue  # follow_learner ends the job: its run is over, or failed by itself
            if name == STANDBY and (self.run_over or not restartable(code)):
                # Exit 0: it found the run ended by its learner (finished, or stopped).
                if code != 0 and not self.run_over:  # failed by itself
                    self.say(
                        f"the standby learner exited with code {code}: the job goes on without one; its log: {proc.log_path}"
                    )
                self.gone.add(name)
                continue
            died = f"{name} exited with code {code} while the learner ran; its log: {proc.log_path}"
            if name == "learner":
                died = f"the learner died (exit code {code}); its log: {proc.log_path}"
            attempt = self.restarts.take(name)
            if not attempt:
                over = f"{died} (restarted {self.restarts.per_hour} times within the hour already)"
                if name == STANDBY:  # the run does not need one
                    self.say(f"{over}: the job goes on without a standby")
                    self.gone.add(name)
                    continue
                self.failure = over
                break
            keeps = "; Redis, reward, reference and the replicas go on" if name == "learner" else ""
            how = "restarting it"
            if name == "learner" and self._standby_alive():
                how = "its warm standby takes over, a new standby starts"
            self.say(
                f"{name} exited with code {code}: {how} ({attempt} of {self.restarts.per_hour} this hour){keeps}"
            )
            self.restarting.add(name)
            self._todo.put((name, died))
        return self.failure

    def _standby_alive(self) -> bool:
        standby = self.stack.standby
        return standby is not None and standby.process.alive()

    def _work(self) -> None:
        from rlmesh.runtime.launcher import LaunchError

        while True:
            name, died = self._todo.get()
            try:
                if name == "learner" and self._standby_alive():
                    # It took the run's lease the moment the learner's process was gone.
                    self.restarting.add("control")  # stopped and started again, pointed at it
                    try:
                        learner = self.stack.promote_standby().process
                    finally:
                        self.restarting.discard("control")
                    self.say(
                        f"learner is back (pid {learner.pid}): its standby took the run over; a new standby starts"
                    )
                    self._back("learner")
                    name = STANDBY
                    new = self.stack.start_standby().process
                else:
                    new = self.stack.restart(name)
            except LaunchError as e:
                if name == STANDBY:  # the run does not need one
                    self.say(
                        f"a new standby learner did not start ({e.headline}): the job goes on without one"
                    )
                    self.gone.add(name)
                    self._back(name)
                else:
                    self.failure = f"{died}; restarting it failed: {e.headline}"
                continue
            self.say(f"{name} is back (pid {new.pid})")
            self._back(name)

    def _back(self, name: str) -> None:
        self.restarting.discard(name)
        self.restarted.set()
        self.restarted.clear()


def learner_state(phase: str, message: str) -> str:
    """The learner's phase and what it says about it, the phase said once ("paused since
    start (...)", not "paused - paused since start (...)")."""
    if not message:
        return phase
    return message if message.startswith(phase) else f"{phase} - {message}"


class PausedTime:
    """How long the learner has been paused, from its status polled now and then: a pause counts
    from the first poll that saw it to the first that did not."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.before = 0.0  # pauses that ended
        self.since: float | None = None  # when the pause under way was first seen

    def seen(self, paused: bool) -> None:
        now = self.clock()
        if paused and self.since is None:
            self.since = now
        elif not paused and self.since is not None:
            self.before += now - self.since
            self.since = None

    @property
    def seconds(self) -> float:
        return self.before + (self.clock() - self.since if self.since is not None else 0.0)


# The learner's phases once its run is over and it has let go of the replicas, the reward and
# Redis (rlmesh.learner.run.loop sets them last): what is left is its process's own exit.
RUN_OVER = ("LEARNER_PHASE_FINISHED", "LEARNER_PHASE_STOPPING")


def follow_learner(
    stack: Any,
    cfg: Any,
    follower: MetricsFollower,
    say: Say,
) -> str:
    """Follows the learner until its run is over (its status says so, or its process exited not
    to be restarted): a line per step (from its metrics rows), what it is doing before its first
    step (from its status), and a restart for any service that dies, the learner included
    (``Supervisor``). Returns why the job must fail because a service could not be kept up, else
    ""."""
    import grpc

    from rlmesh.runtime.auth import bearer_metadata
    from rlmesh.v1 import common_pb2, learner_pb2, learner_pb2_grpc

    metadata = bearer_metadata(cfg.rlmesh.token())
    total, announced = cfg.trainer.total_training_steps or 0, ""
    known_total = 0  # the run's steps as the learner counts them (0: not heard from it yet)
    first: int | None = None  # the step this run started after (> 0 when it resumed)
    last_row = False  # the row of the run's last step is written
    # The elapsed time runs from this run's first step's start, by the rows' own wall times: the
    # learner may be steps ahead of the lines (it trains while the control plane starts).
    started: float | None = None
    paused = PausedTime()

    def show_steps() -> None:
        # One line per step of this run, from the learner's metrics rows: a poll can miss a
        # step, the rows cannot (step 0 is validation before training: no line).
        nonlocal first, last_row, started
        for row in follower.new_rows():
            if "timing_s/step" not in row:
                continue
            step = int(row["step"])
            ended = float(row.get("time", time.time()))
            if first is None:
                first = step - 1
                if started is None:  # a replaced learner's rows go on from the first one's
                    started = float(row.get("timing_start/step", ended - float(row["timing_s/step"])))
                if first:
                    say(f"resumed from the checkpoint of step {first}")
            assert started is not None
            elapsed = max(ended - started, 0.0)
            say(progress_line(step, max(total, step), row, elapsed, step - first, paused.seconds))
            if known_total and step >= known_total:
                last_row = True

    supervisor = Supervisor(stack, RestartBudget(cfg.rlmesh.runtime.max_restarts_per_hour), say)
    process, channel, stub = None, None, None
    try:
        while True:
            failure = supervisor.check()
            if failure:
                return failure
            if stack.learner.process is not process:  # the first, or a new learner: dial it afresh
                process = stack.learner.process
                first = None  # its first row says which checkpoint it resumed from
                if channel is not None:
                    channel.close()
                channel = sync_channel(stack.learner.grpc_address)
                stub = learner_pb2_grpc.LearnerStub(channel)
            if not process.alive():
                if supervisor.check():  # it may have died since the check above
                    return supervisor.failure
                if "learner" not in supervisor.restarting:  # its run is over, or it failed by itself
                    break
                show_steps()
                supervisor.restarted.wait(1.0)  # back, or a second on: the other services' checks
                continue
            try:
                st, refused = stub.GetStatus(common_pb2.Empty(), timeout=5, metadata=metadata), False
            except grpc.RpcError as e:
                st, refused = None, e.code() == grpc.StatusCode.UNAVAILABLE
            if st is not None:
                total = known_total = st.total_steps
                paused.seen(st.phase == learner_pb2.LEARNER_PHASE_PAUSED)
            show_steps()
            # Over: it says so, or, its last step written, its server went away, which it only
            # does once its run let go of everything (LearnerRun: on_end). Its exit takes seconds.
            if (st is not None and learner_pb2.LearnerPhase.Name(st.phase) in RUN_OVER) or (
                refused and last_row and process.alive()
            ):
                supervisor.run_over = True
                break
            if st is not None and first is None:  # before this run's first step: what it is doing
                phase = learner_pb2.LearnerPhase.Name(st.phase).removeprefix("LEARNER_PHASE_").lower()
                line = f"learner: {learner_state(phase, st.message)}"
                if line != announced:
                    say(line)
                    announced = line
            # A status a second; the rows more often, and back at once when the learner exits.
            for _ in range(5 if st is not None else 2):
                try:
                    process.popen.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    show_steps()
                else:
                    break
    finally:
        if channel is not None:
            channel.close()
    show_steps()  # the learner may finish between two polls
    return ""


def follow_fleet_target(stack: Any, cfg: Any, run_id: str, say: Say) -> Any:
    """The actuator of the autoscaler's target for the replicas started here (``LocalFleet``) when
    rlmesh.control.autoscale is on; None when it is off, or this job started no replica."""
    from rlmesh.job.local_fleet import follow_target

    if not cfg.rlmesh.control.autoscale.enabled:
        return None
    if not cfg.rlmesh.control.enabled:
        say(
            "autoscaler: rlmesh.control.enabled is false: no control plane decides, the replicas stay as started"
        )
        return None
    if not stack.rollouts:
        say("autoscaler: no replica started here: size yours from rlmesh_autoscale_desired_replicas")
        return None
    limit = len(stack.rollouts) if any(r.name in stack.envs for r in stack.rollouts) else None
    return follow_target(stack, cfg, run_id, say, limit=limit)


def checkpoint_line(checkpoint_dir: Path) -> str:
    """Which checkpoint running the same command again resumes from (trainer.resume_mode=auto)."""
    from rlmesh.learner.checkpoints.store import checkpoint_step, latest_checkpoint

    path = latest_checkpoint(str(checkpoint_dir))
    if path is None:
        return f"no checkpoint in {checkpoint_dir}: running the same command again starts over"
    try:
        step: int | str = checkpoint_step(path)
    except (OSError, ValueError, KeyError, TypeError):
        step = Path(path).name  # a checkpoint of an older layout: named by its directory
    return f"last checkpoint: step {step} ({path}); running the same command again resumes from it"


def run_job(
    config_path: str | None,
    overrides: Sequence[str],
    *,
    service_dir: Path | None = None,
    say: Say | None = None,
    after_start: Callable[[Any], None] | None = None,
    before_stop: Callable[[Any], None] | None = None,
    export: bool | None = None,
    forkserver: ForkServer | None = None,
) -> JobResult:
    """Starts the stack, follows the learner until it exits, stops everything.

    ``after_start(stack)`` runs once every service is up, ``before_stop(stack)`` while they still
    are (benchmarks read their counters from one to the other). A service that exits while the
    learner runs is restarted (``Supervisor``); one over its restart budget, or that does not come
    back, fails the job, named in ``failure``. With ``export`` True or False the plot is drawn,
    and with True the actor exported, while the services stop (``summarize`` reports them);
    None leaves both to ``summarize``. On Ctrl-C it says which checkpoint the same command
    resumes from, once everything stopped, and raises ``KeyboardInterrupt`` on. The services fork
    from ``forkserver``, else from one started here (rlmesh.runtime.fork_server) and closed after.
    """
    from rlmesh.config import load_config
    from rlmesh.job.stack import start_stack
    from rlmesh.runtime.launcher import LaunchError, ProcessLauncher, start_fork_server
    from rlmesh.runtime.run_file import RunFiles, this_process

    t0 = time.monotonic()
    say = say or say_with("train")
    cfg = load_config(config_path, overrides)
    run_id = cfg.rlmesh.run_id or (
        f"{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    )
    checkpoint_dir = Path(cfg.trainer.default_local_dir).expanduser()
    service_dir = service_dir or checkpoint_dir / "services" / run_id
    overrides = [*overrides, f"rlmesh.run_id={run_id}"]
    if export and not cfg.rlmesh.learner.export_dir:
        # The learner writes it from memory once the last step is done (before it says FINISHED).
        overrides.append(f"rlmesh.learner.export_dir={checkpoint_dir / ACTOR_DIR}")
    export_dir = cfg.rlmesh.learner.export_dir or str(checkpoint_dir / ACTOR_DIR)
    wall_start = time.time()
    result = JobResult(
        code=1,
        run_id=run_id,
        checkpoint_dir=checkpoint_dir,
        service_dir=service_dir,
        wall_s=0,
        started_wall=wall_start,
    )
    token = cfg.rlmesh.token()
    say(f"run {run_id}: checkpoints and metrics in {checkpoint_dir}, logs in {service_dir / 'logs'}")
    follower = MetricsFollower(checkpoint_dir / "metrics.jsonl")
    grace_s = max(cfg.rlmesh.runtime.shutdown_grace_s, 30)
    stack = None
    own = start_fork_server(cfg.rlmesh.runtime.fork_server) if forkserver is None else None
    with (
        own or contextlib.nullcontext(),  # closed last, once the launcher stopped its children
        ProcessLauncher(service_dir, stop_grace_s=grace_s, forkserver=forkserver or own) as launcher,
        RunFiles() as run_files,
    ):
        try:
            try:
                stack = start_stack(launcher, config_path, overrides, say=say)
            except LaunchError as e:
                say(f"start-up failed: {e}")  # with the last lines of the failed service's log
                # One line for stderr, as for a failure while the learner runs: who failed, its log.
                where = f"; its log: {e.log_path}" if e.log_path else ""
                result.failure = f"start-up failed: {e.headline}{where}"
                return result
            if stack.control_url is not None:
                tls = tls_of(cfg.rlmesh.security.tls)
                info = this_process(
                    run_id, stack.control_url, checkpoint_dir, config=config_path, auth=bool(token), tls=tls
                )
                written = run_files.write(info)
                where = f"(run file {written[0]})" if written else f"with --url {stack.control_url}"
                say(f"{'':<12} rlmesh ctl status reaches it {where}")
            fleet = follow_fleet_target(stack, cfg, run_id, say)
            if after_start is not None:
                after_start(stack)
            try:
                result.failure = follow_learner(stack, cfg, follower, say)
            finally:
                if fleet is not None:
                    fleet.close()
            learner = stack.learner  # the last one started: the supervisor may have replaced it
            assert learner is not None
        except KeyboardInterrupt:
            # Ctrl-C, or SIGTERM (rlmesh.cli): the learner ends its step and writes a checkpoint,
            # which the same command resumes from; everything else stops after it.
            say("stopping: the learner ends its step and writes its last checkpoint")
            run_files.remove()  # first: `rlmesh ctl` says no run while the services stop
            resumable: list[str] = []
            if stack is not None:
                stack.stop(meanwhile=lambda: resumable.append(checkpoint_line(checkpoint_dir)))
            say(resumable[0] if resumable else checkpoint_line(checkpoint_dir))
            raise
        run_files.remove()  # first: `rlmesh ctl` says no run while the services stop
        if result.failure:
            say(result.failure)
            stack.stop()
            return result
        # Its run is over (or its process exited): the others are needed no more.
        if learner.process.popen.poll() in (None, 0):
            for replica in stack.rollouts:
                try:
                    result.engines.append(engine_server_info(replica.grpc_address, token))
                except Exception as e:  # the summary falls back to the learner's timings
                    say(f"could not read the engine counters of {replica.name}: {e}")
            if before_stop is not None:
                before_stop(stack)

        def outputs() -> None:
            # While the others stop: the learner's exit, then the plot and the export.
            if learner.process.popen.wait() != 0 or export is None:
                return
            result.rows = read_metrics(checkpoint_dir / "metrics.jsonl")
            plot(result.rows, result.checkpoint_dir / PLOT_FILE)
            written = Path(export_dir).expanduser()
            if export and written_since(written, wall_start):
                result.exported = written
                result.outputs_written = True
            else:  # the learner wrote none (stopped before the last step, or failed to): the last checkpoint's
                write_outputs(result, export, plot_too=False, out=written)

        stack.stop(meanwhile=outputs, learner_exiting=True)
        result.rows = read_metrics(checkpoint_dir / "metrics.jsonl")
        code = learner.process.popen.wait()
        if code != 0:
            result.failure = f"the learner failed (exit code {code}); its log: {learner.process.log_path}"
            why = learner_failure(learner.process.log_path)
            if why:
                result.failure += f"\n{why}"
            result.code = code  # the caller prints the failure, once
            return result
    result.code = 0
    result.wall_s = time.monotonic() - t0
    return result


PLOT_FILE = "training.png"


ACTOR_DIR = "actor-hf"


def written_since(hf_dir: Path, wall_time: float) -> bool:
    """``hf_dir`` is an HF directory whose config.json was written at or after ``wall_time``
    (``time.time()``): this run's export, not an earlier run's left in place."""
    config = hf_dir / "config.json"
    try:
        return config.stat().st_mtime >= wall_time - 1  # file times may be coarser than time.time()
    except OSError:
        return False


def write_outputs(result: JobResult, export: bool, *, plot_too: bool = True, out: Path | None = None) -> None:
    """The plot of the run's metrics rows and, with ``export``, its last checkpoint's actor as an
    HF directory (``out``, default ``<checkpoint dir>/actor-hf``), in this process; ``result``
    records them."""
    # Not `rlmesh.learner`'s package exports: those import the trainer and DeepSpeed (seconds).
    from rlmesh.learner.checkpoints.export import export_checkpoint
    from rlmesh.learner.checkpoints.store import latest_checkpoint

    if plot_too:
        plot(result.rows, result.checkpoint_dir / PLOT_FILE)
    checkpoint = latest_checkpoint(str(result.checkpoint_dir))
    if export and checkpoint is not None:
        result.exported = export_checkpoint(checkpoint, out or result.checkpoint_dir / ACTOR_DIR)
    result.outputs_written = True


def summarize(
    result: JobResult,
    title: str,
    *,
    export: bool = True,
    extra: dict[str, Any] | None = None,
    started_at: float | None = None,
) -> int:
    """Prints the summary table and one JSON line for scripts, writes the plot, exports the actor
    to ``<checkpoint dir>/actor-hf``; returns the exit code (1: the export failed). With ``started_at`` (a
    ``time.monotonic()``) the wall time runs from then to the end of the export; otherwise it is
    the job's, start-up to the learner's exit. What ``run_job(export=...)`` wrote while the
    services stopped is reported, not written again."""
    if not result.outputs_written:
        write_outputs(result, export)
    rows = result.rows
    steps = int(max((r["step"] for r in rows), default=0))
    vals = [r for r in rows if "val/score" in r]
    plot_path = result.checkpoint_dir / PLOT_FILE
    exported = result.exported
    if started_at is not None:
        result.wall_s = time.monotonic() - started_at
    rates = stage_rates(rows, result.engines)
    print()
    print(f"  {title}")
    print("  ----------------------------------------------")
    summary: dict[str, Any] = {}
    if vals:
        before, after = vals[0]["val/score"], vals[-1]["val/score"]
        summary.update(acc_before=before, acc_after=after)
        print(f"  validation score before      {before:7.1%}   (step {int(vals[0]['step'])})")
        print(f"  validation score after       {after:7.1%}   ({(after - before) * 100:+.1f} points)")
    this_run = [r["step"] for r in rows if "timing_s/step" in r and r.get("time", 0) >= result.started_wall]
    resumed = f"   ({int(min(this_run))}-{steps} this run, resumed)" if this_run and min(this_run) > 1 else ""
    print(f"  PPO steps                    {steps:7d}{resumed}")
    print(f"  wall time                    {result.wall_s:7.0f} s")
    failed = reward_failures(rows)
    if failed is not None:
        summary.update(reward_failed=failed[0], reward_scored=failed[1])
        print(
            f"  reward failed                {failed[0] / failed[1]:7.1%}   ({failed[0]} of {failed[1]} "
            "training samples; the first, with its file and line, in the learner's log)"
        )
    for key, value in rates.items():
        print(f"  {key.replace('_', ' '):<28} {value:7.0f}")
    print(f"  metrics   {result.checkpoint_dir / 'metrics.jsonl'}")
    print(f"  plot      {plot_path}")
    print(f"  actor     {exported or result.export_failure or '(no checkpoint to export)'}")
    print(f"  logs      {result.service_dir / 'logs'}")
    print()
    summary.update(
        steps=steps,
        wall_s=round(result.wall_s, 1),
        **{k: round(v, 1) for k, v in rates.items()},
        exported_actor=str(exported) if exported else None,
        checkpoint_dir=str(result.checkpoint_dir),
        run_id=result.run_id,
        **(extra or {}),
    )
    print(json.dumps(summary), flush=True)
    return 1 if result.export_failure else 0


def reward_failures(rows: list[dict[str, float]]) -> tuple[int, int] | None:
    """Training samples whose reward failed, and all scored, over the steps of ``rows``; None when
    none failed."""
    failed = scored = 0
    for row in rows:
        n, ratio = row.get("reward/failed", 0.0), row.get("reward/failed_ratio", 0.0)
        if "timing_s/step" in row and n > 0 and ratio > 0:
            failed, scored = failed + round(n), scored + round(n / ratio)
    return (failed, scored) if failed else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlmesh train",
        description="Run a PPO job: start what the config needs on this machine, train, export the actor.",
        epilog="Attach to services already running by giving rlmesh.redis_url, rlmesh.reward.addresses, "
        "rlmesh.reference.addresses, or rlmesh.rollout.replicas=0. Run the same command again to resume.",
    )
    p.add_argument("--config", "-c", default=None, help="YAML config file (verl key names)")
    p.add_argument("--no-export", action="store_true", help="do not export the actor at the end")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, as verl's main_ppo takes them")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from rlmesh.config import ConfigError, load_config

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = build_parser()
    parser.add_argument(
        "--skip-preflight",
        action="store_true",
        help="start without first checking the model, tokenizer, data and reward the config names, nor "
        "whether the run is already finished (rlmesh config validate runs those checks alone)",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rlmesh train: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    from rlmesh.runtime.launcher import start_fork_server

    # It imports while the pre-flight runs.
    with start_fork_server(cfg.rlmesh.runtime.fork_server) or contextlib.nullcontext() as forkserver:
        return _checked_run(args, cfg, forkserver)


def _checked_run(args: argparse.Namespace, cfg: Any, forkserver: ForkServer | None) -> int:
    if not args.skip_preflight:
        # What the services would fail on once started, and a run with nothing left to train: found
        # before anything starts or any directory is made.
        from rlmesh.job.preflight import format_problems, run_preflight

        say = say_with("train")
        report = run_preflight(cfg, progress=lambda step: say(f"pre-flight: {step}"))
        if report.problems:
            print(
                "rlmesh train: the pre-flight checks found what would fail the job; nothing was started:\n"
                + format_problems(report),
                file=sys.stderr,
            )
            return 2
        for note in report.notes:
            say(f"note: {note}")
        if report.finished is not None:
            print(f"rlmesh train: {report.finished.line()}", flush=True)
            return 0
    if cfg.trainer.save_freq <= 0:
        print(
            f"rlmesh train: trainer.save_freq={cfg.trainer.save_freq} (verl's default): no checkpoint will be "
            "written, so running this command again starts over (the actor is still exported at the end); set "
            "trainer.save_freq to keep them",
            file=sys.stderr,
            flush=True,
        )
    result = run_job(args.config, args.overrides, export=not args.no_export, forkserver=forkserver)
    if result.code != 0:
        print(f"rlmesh train: {result.failure or 'failed'}", file=sys.stderr)
        return result.code
    title = f"rlmesh train: {cfg.trainer.project_name} / {cfg.trainer.experiment_name}"
    return summarize(result, title, export=not args.no_export)


if __name__ == "__main__":
    sys.exit(main())
