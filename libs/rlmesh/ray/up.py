"""``rlmesh ray up``: a whole PPO job on a Ray cluster, every service an actor placed by its
resources; it follows the learner to the end and stops every actor on the way out."""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlmesh.config import RLMeshConfig
from rlmesh.job.train import progress_line, say_with
from rlmesh.ray.actors import Actor, Say, connect, create, describe, stop_actors, wait_started
from rlmesh.ray.plan import ActorPlan, PlanError, plan_actors, unplaceable
from rlmesh.ray.shell import ShellSpec


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
    """Polls every actor's ``status`` once a second until the learner exits: progress lines from the
    learner's metrics rows, a line when an actor dies and when Ray brought it back."""

    def __init__(self, actors: Sequence[Actor], learner: Actor, total: int, say: Say) -> None:
        self.actors, self.learner, self.total, self.say = list(actors), learner, total, say
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

    def run(self) -> tuple[int, str]:
        """The learner's exit code and, when the run failed, why."""
        import ray
        from ray.exceptions import RayActorError

        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
        pending: dict[object, Actor] = {}
        quiet_since = time.monotonic()
        while True:
            t0 = time.monotonic()
            for actor in self.actors:
                if actor not in pending.values():
                    pending[actor.handle.status.remote()] = actor
            # A restarting actor's call waits for its new constructor: it stays pending meanwhile.
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=1.0)
            for ref in ready:
                actor = pending.pop(ref)
                name = actor.plan.name
                try:
                    status = ray.get(ref)
                except unavailable:
                    continue  # on its way to a restart: the next call waits for it
                except RayActorError as e:
                    if actor is self.learner:
                        return (
                            1,
                            f"the learner's actor died: {_first_line(e)} (stopped by `rlmesh ray down`?)",
                        )
                    actor.deaths += 1
                    if actor.deaths > actor.plan.max_restarts:
                        return 1, (
                            f"{name}'s actor died {actor.deaths} times, more than --max-restarts "
                            f"{actor.plan.max_restarts}: {_first_line(e)}"
                        )
                    self.say(
                        f"{name}'s actor died ({_first_line(e)}): Ray restarts it "
                        f"({actor.deaths} of {actor.plan.max_restarts})"
                    )
                    continue
                if status["actor_pid"] != actor.status.get("actor_pid"):
                    self.say(f"{name} is back: {describe(status)}")
                actor.status = status
                if status["stopped"]:
                    return 1, f"{name} was stopped from outside this command (`rlmesh ray down`?)"
                if status["rows"]:
                    self.show(status["rows"])
                    quiet_since = time.monotonic()
                if actor is self.learner and status["exit_code"] is not None:
                    code = int(status["exit_code"])
                    if code != 0:
                        return code, f"the learner failed (exit code {code}); its log: {status['log']}"
                    return 0, ""
            if time.monotonic() - quiet_since > 30:
                self.say(f"no step finished in the last 30 s (at step {self.last_step})")
                quiet_since = time.monotonic()
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))  # a poll period, not a wait for a state


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
        restart_on_exit=plan.max_restarts > 0,
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
        code, failure = follower.run()
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
