"""A ``rlmesh ray up`` job's replica actors as the autoscaler's actuator (``LocalFleet``) sees a
stack: a new actor placed by Ray, or the newest one's service stopped with SIGTERM (it drains) and
its actor killed. docs/control.md#autoscaling"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from rlmesh.ray.actors import Actor, create, stop_actors, wait_started
from rlmesh.ray.plan import ActorPlan
from rlmesh.ray.shell import ShellSpec
from rlmesh.runtime.launcher import LaunchError


class RayReplicas:
    """``actors``: every actor the job started (its ``stop`` at the end stops them all) and
    ``followed``: the ones its ``Follower`` watches; an added replica joins both, a removed one
    leaves both before it is stopped (its death is then no death to count)."""

    def __init__(
        self,
        *,
        actors: list[Actor],
        followed: list[Actor],
        run_id: str,
        redis_url: str,
        spec_of: Callable[[ActorPlan], ShellSpec],
        grace_s: float,
        say: Callable[[str], None],
    ) -> None:
        self.actors, self.followed = actors, followed
        self.run_id, self.redis_url, self.spec_of = run_id, redis_url, spec_of
        self.grace_s, self.say = grace_s, say
        replicas = [a for a in actors if a.plan.service == "rollout"]
        assert replicas, "the autoscaler's Ray actuator needs one replica actor to copy"
        self.template = replicas[0].plan
        self.started = len(replicas)
        self.lock = threading.Lock()

    @property
    def rollouts(self) -> list[SimpleNamespace]:
        with self.lock:
            return [SimpleNamespace(name=a.plan.name) for a in self.followed if a.plan.service == "rollout"]

    def add_replica(self) -> SimpleNamespace:
        import ray

        name = f"rollout-{self.started}"
        self.started += 1
        plan = dataclasses.replace(
            self.template, name=name, extra_overrides=(f"rlmesh.sampler.replica_id={name}",)
        )
        actor = create(plan, self.run_id, self.spec_of(plan))
        with self.lock:
            self.actors.append(actor)  # stopped with the rest at the end, healthy or not
        try:
            wait_started([actor], self.say)
        except ray.exceptions.RayError as e:
            raise LaunchError(
                f"{name}'s actor did not start: {e}", headline=f"{name}'s actor did not start"
            ) from None
        with self.lock:
            self.followed.append(actor)
        status = actor.status
        return SimpleNamespace(
            name=name, grpc_address=status["address"], process=SimpleNamespace(pid=status["pid"])
        )

    def replica_alive(self, name: str) -> bool:
        """Always: Ray restarts a dead replica's actor itself, and a call to it waits for that."""
        return True

    def remove_replica(self, name: str) -> int | None:
        with self.lock:
            actor = next(a for a in self.followed if a.plan.name == name)
            self.followed.remove(actor)
            self.actors.remove(actor)
        stop_actors([(actor.plan.actor_name(self.run_id), actor.handle)], self.say, self.grace_s)
        return None  # its exit code is in the line stop_actors says


def ray_fleet_target(
    cfg: Any,
    run_id: str,
    redis_url: str,
    actors: list[Actor],
    followed: list[Actor],
    spec_of: Callable[[ActorPlan], ShellSpec],
    say: Callable[[str], None],
) -> Any:
    """``LocalFleet`` over the job's replica actors when rlmesh.control.autoscale is on, else None."""
    from rlmesh.job.local_fleet import follow_target

    if not cfg.rlmesh.control.autoscale.enabled or not any(a.plan.service == "rollout" for a in actors):
        return None
    replicas = RayReplicas(
        actors=actors,
        followed=followed,
        run_id=run_id,
        redis_url=redis_url,
        spec_of=spec_of,
        grace_s=max(cfg.rlmesh.runtime.shutdown_grace_s, 30.0),
        say=say,
    )
    return follow_target(replicas, cfg, run_id, say, what="replica actors")
