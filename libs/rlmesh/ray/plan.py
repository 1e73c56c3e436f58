"""What ``rlmesh ray up`` asks Ray for: one actor per service, its resources and restarts.

Pure: no Ray import, so the plan is checked (and tested) where Ray is not installed."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rlmesh.config import RLMeshConfig

NAMESPACE = "rlmesh"  # every actor of every run; a run's actors are named "<run id>/<name>"
SERVICES = ("redis", "reward", "reference", "rollout", "learner", "control")


class PlanError(ValueError):
    """A flag or a config that gives no actor plan; the message says which and why."""


@dataclass(frozen=True)
class ActorPlan:
    """One actor: the service its shell runs, under which name, with what resources."""

    service: str
    name: str
    num_cpus: float
    num_gpus: float
    resources: dict[str, float] = field(default_factory=dict)
    max_restarts: int = 0
    extra_overrides: tuple[str, ...] = ()  # this actor's own, after the run's (a replica's id)

    def actor_name(self, run_id: str) -> str:
        return f"{run_id}/{self.name}"

    def demand(self) -> dict[str, float]:
        """Everything it asks of one node, in Ray's resource names."""
        need = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in need.items() if v > 0}


def parse_service_values(items: Iterable[str], flag: str, kind: str) -> dict[str, object]:
    """``SERVICE=VALUE`` flags (``--num-cpus rollout=2``, ``--resources rollout='{"node2": 1}'``), by
    service; ``kind`` is ``number`` or ``json`` (an object of resource name to amount)."""
    out: dict[str, object] = {}
    for item in items:
        service, sep, value = item.partition("=")
        if not sep or service not in SERVICES:
            raise PlanError(
                f"{flag} {item!r}: expected SERVICE=VALUE with SERVICE one of {', '.join(SERVICES)}"
            )
        try:
            parsed = json.loads(value) if kind == "json" else float(value)
        except ValueError as e:
            raise PlanError(
                f"{flag} {item!r}: {value!r} is not {'JSON' if kind == 'json' else 'a number'}"
            ) from e
        if kind == "json":
            if not isinstance(parsed, dict) or not all(
                isinstance(k, str) and isinstance(v, int | float) and v >= 0 for k, v in parsed.items()
            ):
                raise PlanError(f"{flag} {item!r}: expected a JSON object of resource name to amount >= 0")
            if {"CPU", "GPU"} & set(parsed):
                raise PlanError(f"{flag} {item!r}: give CPU and GPU with --num-cpus and --num-gpus")
        elif parsed < 0:  # type: ignore[operator]
            raise PlanError(f"{flag} {item!r}: must be >= 0")
        out[service] = parsed
    return out


def default_gpus(cfg: RLMeshConfig, service: str) -> float:
    """GPUs an actor needs by the config: none on CPU; one per learner rank, the engine's tensor
    parallel size per SGLang replica, one for a reference on CUDA."""
    if cfg.trainer.device != "cuda":
        return 0.0
    if service == "learner":
        return float(cfg.rlmesh.learner.ranks)
    if service == "rollout":
        rollout = cfg.actor_rollout_ref.rollout
        return float(rollout.tensor_model_parallel_size) if rollout.name == "sglang" else 0.0
    if service == "reference":
        return 0.0 if (cfg.rlmesh.reference.device or "cuda").startswith("cpu") else 1.0
    return 0.0


DEFAULT_CPUS = {"redis": 0.0, "reward": 1.0, "reference": 1.0, "rollout": 1.0, "learner": 1.0, "control": 0.0}


def plan_actors(
    cfg: RLMeshConfig,
    *,
    given: Sequence[str] = (),
    num_cpus: Mapping[str, object] | None = None,
    num_gpus: Mapping[str, object] | None = None,
    resources: Mapping[str, object] | None = None,
    max_restarts: int = 3,
) -> list[ActorPlan]:
    """The actors of a run in start order, as ``rlmesh train`` starts processes: Redis unless
    ``rlmesh.redis_url`` is ``given`` (a key the user set), reward and reference unless their
    addresses are given (no reference when colocated), ``rlmesh.rollout.replicas`` replicas and
    the learner (Ray restarts each up to ``max_restarts`` times; the learner only when it died: a
    learner that finished or failed by itself ends the run), and the control plane
    (``rlmesh.control.enabled``)."""
    if max_restarts < 0:
        raise PlanError(f"--max-restarts {max_restarts}: must be >= 0")
    num_cpus, num_gpus, resources = num_cpus or {}, num_gpus or {}, resources or {}

    def plan(service: str, name: str, restarts: int = 0, extra: Sequence[str] = ()) -> ActorPlan:
        return ActorPlan(
            service=service,
            name=name,
            num_cpus=float(num_cpus.get(service, DEFAULT_CPUS[service])),  # type: ignore[arg-type]
            num_gpus=float(num_gpus.get(service, default_gpus(cfg, service))),  # type: ignore[arg-type]
            resources={k: float(v) for k, v in dict(resources.get(service, {})).items()},  # type: ignore[call-overload]
            max_restarts=restarts,
            extra_overrides=tuple(extra),
        )

    plans = [] if "rlmesh.redis_url" in given else [plan("redis", "redis")]
    if not cfg.rlmesh.reward.addresses:
        plans.append(plan("reward", "reward"))
    if not cfg.rlmesh.reference.colocated and not cfg.rlmesh.reference.addresses:
        reference = plan("reference", "reference")
        if "reference" not in num_gpus and reference.num_gpus and not cfg.rlmesh.placement.reference_gpus:
            # The GPU plan shares the learner's first GPU with it; Ray gives whole GPUs to one actor.
            raise PlanError(
                "the reference service runs on CUDA and rlmesh.placement.reference_gpus=0 has it share the "
                "learner's first GPU, which Ray cannot do: set rlmesh.placement.reference_gpus=1 (a GPU of "
                "its own), rlmesh.reference.colocated=true, rlmesh.reference.device=cpu, or --num-gpus "
                "reference=N"
            )
        plans.append(reference)
    for i in range(cfg.rlmesh.rollout.replicas):
        name = f"rollout-{i}"
        plans.append(plan("rollout", name, max_restarts, [f"rlmesh.sampler.replica_id={name}"]))
    plans.append(plan("learner", "learner", max_restarts))
    if cfg.rlmesh.control.enabled:
        plans.append(plan("control", "control"))
    return plans


def unplaceable(plans: Sequence[ActorPlan], nodes: Sequence[Mapping[str, float]]) -> list[str]:
    """Each plan no single node could ever hold (``nodes``: every live node's total resources), with
    what it asks: Ray would keep such an actor pending forever, without an error."""
    problems = []
    for p in plans:
        need = p.demand()
        if not any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes):
            asks = ", ".join(f"{k}={v:g}" for k, v in need.items()) or "nothing"
            problems.append(f"{p.name} asks for {asks}: no node of the cluster has that much")
    return problems
