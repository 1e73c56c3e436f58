"""``rlmesh ray down``: stops the actors of rlmesh runs on a Ray cluster (one run, or all), their
services first, from any machine of the cluster."""

from __future__ import annotations

from rlmesh.job.train import say_with
from rlmesh.ray.actors import connect, stop_actors
from rlmesh.ray.plan import NAMESPACE


def run_down(address: str, run_id: str | None, grace_s: float) -> int:
    import ray

    say = say_with("ray down")
    connect(address)
    try:
        names = sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and (run_id is None or a["name"].startswith(f"{run_id}/"))
        )
        if not names:
            say(f"no rlmesh actors{f' of run {run_id}' if run_id else ''} on this cluster")
            return 0
        runs = sorted({n.split("/", 1)[0] for n in names})
        say(f"stopping {len(names)} actors of {', '.join(runs)}")
        handles = []
        for name in names:
            try:
                handles.append((name, ray.get_actor(name, namespace=NAMESPACE)))
            except ValueError:
                say(f"{name}: already gone")
        stop_actors(handles, say, grace_s)
        return 0
    finally:
        ray.shutdown()
