"""``rlmesh ray up``: a whole PPO job on a Ray cluster, every service an actor placed by its
resources; it follows the learner to the end (through Ray's restarts of it and of the replicas)
and stops every actor on the way out."""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlmesh.config import RLMeshConfig
from rlmesh.job.train import progress_line, say_with
from rlmesh.ray.actors import Actor, Say, connect, create, describe, stop_actors, wait_started
from rlmesh.ray.plan import ActorPlan, PlanError, plan_actors, unplaceable
from rlmesh.ray.replicas import ray_fleet_target
from rlmesh.ray.shell import ShellSpec
from rlmesh.runtime.launcher import restartable


@dataclass
class UpOptions:
    """``rlmesh ray up``'s flags, parsed."""

    config: str | None
    overrides: list[str]
    address: str
    num_cpus: dict[str, object]
    num_gpus: dict[str, object]
    resources: dict[str, object]
    max_restarts: int
    workdir: str | None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class Follower:
    """Polls every actor's ``status`` once a second until the learner's run is over: progress lines
    from the learner's metrics rows, a line when an actor dies and when Ray brought it back. A
    restarted learner listens on a new address, which the control plane is pointed at."""

    def __init__(self, actors: Sequence[Actor], learner: Actor, total: int, say: Say) -> None:
        self.actors, self.learner, self.total, self.say = list(actors), learner, total, say
        self.control = next((a for a in self.actors if a.plan.service == "control"), None)
        self.first: int | None = None  # the step this run started after (> 0 when it resumed)
        self.last_step = 0
        self.started = time.monotonic()

    def show(self, rows: list[dict[str, float]]) -> None:
        for row in rows:
            if "timing_s/step" not in row:  # step 0 is validation before training: no line
                continue
            step = int(row["step"])
            if self.first is None:
                self.first = step - 1
                if self.first:
                    self.say(f"resumed from the checkpoint of step {self.first}")
            self.last_step = step
            elapsed = time.monotonic() - self.started
            self.say(progress_line(step, max(self.total, step), row, elapsed, done=step - self.first))

    def repoint_control(self, address: str) -> None:
        """The control plane, started again by its actor on its URL, pointed at the learner's new
        ``address``. One that does not come back is said, not fatal: the run goes on without it."""
        import ray

        if self.control is None:
            return
        try:
            status = ray.get(self.control.handle.repoint.remote(address))
        except ray.exceptions.RayError as e:
            self.say(f"the control plane did not come back pointed at the new learner: {_first_line(e)}")
            return
        self.control.status = status
        self.say(f"control plane: pointed at the new learner at {address} (pid {status['pid']})")

    def died(self, actor: Actor, why: str, down: str) -> str:
        """Counts and says a death of ``actor`` within its restart budget (``why``: its first
        sign); returns why the run fails when it is over the budget."""
        actor.deaths, actor.down = actor.deaths + 1, down
        who, budget = actor.plan.name, actor.plan.max_restarts
        hint = ""
        if actor is self.learner:
            who, hint = "the learner", " (stopped by `rlmesh ray down`?)"
            if not budget:
                return f"the learner's actor died: {why}{hint}"
        if actor.deaths > budget:
            return f"{who}'s actor died {actor.deaths} times, more than --max-restarts {budget}: {why}{hint}"
        self.say(f"{who}'s actor died ({why}): Ray restarts it ({actor.deaths} of {budget})")
        return ""

    def run(self) -> tuple[int, str]:
        """The learner's exit code and, when the run failed, why."""
        import ray
        from ray.exceptions import RayActorError

        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
        pending: dict[object, Actor] = {}
        quiet_since = time.monotonic()
        while True:
            t0 = time.monotonic()
            for actor in list(self.actors):  # the autoscaler's actuator adds and removes replicas
                if actor not in pending.values():
                    pending[actor.handle.status.remote()] = actor
            # A restarting actor's call waits for its new constructor: it stays pending meanwhile.
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=1.0)
            for ref in ready:
                actor = pending.pop(ref)
                if actor not in self.actors:  # a replica the autoscaler stopped: its end is no death
                    continue
                name = actor.plan.name
                try:
                    status = ray.get(ref)
                except unavailable:
                    continue  # on its way to a restart: the next call waits for it
                except RayActorError as e:
                    # A call failed by the dying worker of a death already counted is that death;
                    # calls to an actor Ray restarts wait for it, so further failures are deaths.
                    failure = "" if actor.down == "exit" else self.died(actor, _first_line(e), "error")
                    if failure:
                        return 1, failure
                    actor.down = "error"
                    continue
                if status["actor_pid"] != actor.status.get("actor_pid"):
                    if not actor.down:  # no call saw it die: its new incarnation is the first sign
                        failure = self.died(actor, f"worker pid {actor.status.get('actor_pid')} gone", "")
                        if failure:
                            return 1, failure
                    actor.down = ""
                    self.say(f"{name} is back: {describe(status)}")
                    if actor is self.learner:
                        self.show(status["earlier_rows"])  # the dead learner's last, unseen rows
                        self.first = None  # the new one's first row says which checkpoint it resumed from
                        if status["address"] != actor.status.get("address"):
                            self.repoint_control(status["address"])
                actor.status = status
                if status["stopped"]:
                    return 1, f"{name} was stopped from outside this command (`rlmesh ray down`?)"
                if status["rows"]:
                    self.show(status["rows"])
                    quiet_since = time.monotonic()
                if actor is self.learner and status["exit_code"] is not None:
                    code = int(status["exit_code"])
                    if actor.plan.max_restarts and restartable(code):
                        # It died: its shell ends the actor, for Ray to restart it.
                        if not actor.down:
                            why = f"its service exited with code {code}; its log: {status['log']}"
                            failure = self.died(actor, why, "exit")
                            if failure:
                                return 1, failure
                        continue
                    if code != 0:
                        return code, f"the learner failed (exit code {code}); its log: {status['log']}"
                    return 0, ""
            if time.monotonic() - quiet_since > 30:
                self.say(f"no step finished in the last 30 s (at step {self.last_step})")
                quiet_since = time.monotonic()
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))  # a poll period, not a wait for a state


def restart_rule(plan: ActorPlan) -> Literal["", "exit", "death"]:
    """Which exits of its service end an actor for Ray to restart it (``ShellSpec.restart_on``):
    none without restarts; for the learner only a death, since its exit 0 (the run is over) or 1
    (an error of its own, which would only repeat) is the run's end; for a replica any exit."""
    if not plan.max_restarts:
        return ""
    return "death" if plan.service == "learner" else "exit"


def _spec(
    plan: ActorPlan, opts: UpOptions, overrides: Sequence[str], workdir: Path, cfg: RLMeshConfig
) -> ShellSpec:
    timeout_s = cfg.rlmesh.runtime.health_timeout_s
    return ShellSpec(
        service=plan.service,
        name=plan.name,
        workdir=str(workdir),
        config_text=Path(opts.config).read_text() if opts.config else None,
        overrides=(*overrides, *plan.extra_overrides),
        cwd=os.getcwd(),
        health_timeout_s=max(timeout_s, 600.0) if plan.service in ("rollout", "learner") else timeout_s,
        stop_grace_s=max(cfg.rlmesh.runtime.shutdown_grace_s, 30.0),
        restart_on=restart_rule(plan),
    )


def run_up(opts: UpOptions) -> int:
    from rlmesh.config import ConfigError, given_keys, load_config

    say = say_with("ray")
    overrides = list(opts.overrides)
    try:
        cfg = load_config(opts.config, overrides)
        plans = plan_actors(
            cfg,
            given=sorted(given_keys(opts.config, overrides)),
            num_cpus=opts.num_cpus,
            num_gpus=opts.num_gpus,
            resources=opts.resources,
            max_restarts=opts.max_restarts,
        )
    except ConfigError as e:
        print(f"rlmesh ray up: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    except PlanError as e:
        print(f"rlmesh ray up: {e}", file=sys.stderr)
        return 2
    run_id = cfg.rlmesh.run_id or (
        f"{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    )
    overrides.append(f"rlmesh.run_id={run_id}")
    checkpoint_dir = Path(cfg.trainer.default_local_dir).expanduser().resolve()
    workdir = Path(opts.workdir or checkpoint_dir / "services" / run_id).expanduser().resolve()

    import ray

    t0 = time.monotonic()
    say(f"connecting to Ray at {opts.address}")
    connect(opts.address)
    actors: list[Actor] = []
    try:
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        total = ray.cluster_resources()
        say(
            f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}, {total.get('CPU', 0):g} CPUs, "
            f"{total.get('GPU', 0):g} GPUs"
        )
        problems = unplaceable(plans, nodes)
        if problems:
            print("rlmesh ray up: cannot place every service:\n" + "\n".join(problems), file=sys.stderr)
            return 2
        say(
            f"run {run_id}: checkpoints and metrics in {checkpoint_dir}, logs in {workdir / 'logs'} (each on its node)"
        )

        def start(phase: list[ActorPlan]) -> list[Actor]:
            started = [create(p, run_id, _spec(p, opts, overrides, workdir, cfg)) for p in phase]
            actors.extend(started)
            wait_started(started, say)
            return started

        # The order `rlmesh train` starts processes in: each phase needs the addresses of the last.
        for actor in start([p for p in plans if p.service == "redis"]):
            overrides.append(f"rlmesh.redis_url={actor.status['address']}")
        for actor in start([p for p in plans if p.service in ("reward", "reference")]):
            overrides.append(f"rlmesh.{actor.plan.service}.addresses=['{actor.status['address']}']")
        start([p for p in plans if p.service in ("rollout", "learner")])
        learner = next(a for a in actors if a.plan.service == "learner")
        overrides.append(f"rlmesh.learner.addresses=['{learner.status['address']}']")
        for actor in start([p for p in plans if p.service == "control"]):
            url = f"http://{actor.status['address']}"
            say(f"control plane: {url}/dashboard/ (rlmesh ctl --url {url})")
        say(f"{len(actors)} actors healthy after {time.monotonic() - t0:.0f} s")
        follower = Follower(actors, learner, cfg.trainer.total_training_steps or 0, say)
        redis_url = next(
            (o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("rlmesh.redis_url=")), ""
        )
        fleet = ray_fleet_target(
            cfg,
            run_id,
            redis_url or cfg.rlmesh.redis_url,
            actors,
            follower.actors,
            lambda plan: _spec(plan, opts, overrides, workdir, cfg),
            say,
        )
        try:
            code, failure = follower.run()
        finally:
            if fleet is not None:
                fleet.close()
        if failure:
            say(failure)
            print(f"rlmesh ray up: {failure}", file=sys.stderr)
            return code or 1
        say(
            f"run {run_id} finished at step {follower.last_step} after {time.monotonic() - t0:.0f} s: "
            f"metrics and checkpoints in {checkpoint_dir} on node {learner.status['node_ip']} "
            "(`rlmesh export` writes the actor as an HF directory)"
        )
        return 0
    except ray.exceptions.RayActorError as e:  # a constructor failed: the service's log is in it
        say(f"start-up failed: {e}")
        print(f"rlmesh ray up: start-up failed: {_first_line(e)}", file=sys.stderr)
        return 1
    finally:
        if actors:
            say(f"stopping {len(actors)} actors")
            grace = max(cfg.rlmesh.runtime.shutdown_grace_s, 30.0)
            stop_actors([(a.plan.actor_name(run_id), a.handle) for a in actors], say, grace)
        ray.shutdown()
