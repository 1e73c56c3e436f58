"""The driver's side of the actors: creating them from a plan, waiting for them with progress, and
stopping them (learner first, Redis last), from ``ray up`` and from ``ray down`` alike."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlmesh.config.secrets import redact_url
from rlmesh.ray.plan import NAMESPACE, ActorPlan
from rlmesh.ray.shell import ServiceShell, ShellSpec

Say = Callable[[str], None]
STOP_ORDER = ("learner", "rollout", "reference", "reward", "redis")  # Redis last: others deregister in it


@dataclass
class Actor:
    """One actor of the run, as the driver follows it."""

    plan: ActorPlan
    handle: Any  # ray.actor.ActorHandle
    status: dict[str, Any] = field(default_factory=dict)  # the last status() it answered
    deaths: int = 0
    # Its death is counted and its return not yet seen: "exit" (its service died, its shell about
    # to end the worker, whose dying may still fail a call) or "error" (a call failed).
    down: str = ""


def connect(address: str) -> None:
    """Joins the cluster as a driver. Ray's core worker installs its own SIGTERM handler (it logs
    and aborts); the command's own, which unwinds like Ctrl-C so every actor is stopped, goes back."""
    import ray

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


def create(plan: ActorPlan, run_id: str, spec: ShellSpec) -> Actor:
    """The actor, created (Ray places it and runs the shell's constructor asynchronously)."""
    import ray

    options: dict[str, Any] = {
        "name": plan.actor_name(run_id),
        "namespace": NAMESPACE,
        "num_cpus": plan.num_cpus,
        "num_gpus": plan.num_gpus,
        "max_restarts": plan.max_restarts,
        "max_task_retries": 0,  # a status call in flight at a death fails: that is how we see it
    }
    if plan.resources:
        options["resources"] = plan.resources
    handle = ray.remote(ServiceShell).options(**options).remote(spec)
    return Actor(plan=plan, handle=handle)


def describe(status: dict[str, Any]) -> str:
    res = ", ".join(f"{k} {v:g}" for k, v in sorted(status["resources"].items())) or "no resources"
    return f"{redact_url(status['address'])} (node {status['node_id'][:8]} {status['node_ip']}, pid {status['pid']}, {res})"


def wait_started(actors: Sequence[Actor], say: Say, progress_every_s: float = 15.0) -> None:
    """Until every actor's service is healthy; says which still start every ``progress_every_s``.
    Raises ``ray.exceptions.RayActorError`` (its creation failed: the service's log is in it)."""
    import ray

    refs = {a.handle.status.remote(): a for a in actors}
    t0 = time.monotonic()
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=progress_every_s)
        if not ready:
            waiting = ", ".join(a.plan.name for a in refs.values())
            say(f"waiting for {waiting} to be placed and healthy ({time.monotonic() - t0:.0f} s)")
            continue
        actor = refs.pop(ready[0])
        actor.status = ray.get(ready[0])
        say(f"{actor.plan.name:<12} {describe(actor.status)}")


def stop_actors(handles: Sequence[tuple[str, Any]], say: Say, grace_s: float) -> None:
    """Stops the services gracefully (``stop``: SIGTERM, then SIGKILL after the grace), in
    ``STOP_ORDER`` by service, each group at once, then kills every actor for good. An actor
    that does not answer within the grace (still starting, or gone) is killed all the same: its
    services die with its worker (their parent-death signal)."""
    import ray

    def group(name: str) -> int:
        service = name.rsplit("/", 1)[-1].split("-", 1)[0]
        return STOP_ORDER.index(service) if service in STOP_ORDER else 0

    for rank in sorted({group(n) for n, _ in handles}):
        batch = [(n, h) for n, h in handles if group(n) == rank]
        refs = {h.stop.remote(): n for n, h in batch}
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=grace_s + 15)
        for ref in late:
            say(f"{refs[ref]} did not answer stop within {grace_s + 15:.0f} s: killing its actor")
        for ref in ready:
            try:
                code = ray.get(ref)
                say(f"stopped {refs[ref]} (exit code {code})")
            except ray.exceptions.RayError as e:
                say(f"{refs[ref]}: already gone ({type(e).__name__})")
        for _, h in batch:
            with contextlib.suppress(ray.exceptions.RayError):  # already dead: nothing to kill
                ray.kill(h, no_restart=True)
    say(f"every actor stopped ({len(handles)})")
