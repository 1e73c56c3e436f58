"""A real Prometheus scrapes a real short run, with deploy/alerts.yml loaded, and every Grafana panel's
query and every alert rule's expression returns data: the dashboard and the rules name metrics the
services really export, with the labels they really carry.

An alert's expression is checked without its comparisons with a number (``> 0.03``): what it selects
and computes, which has data in a healthy run although the alert does not fire. docs/monitoring.md"""

from __future__ import annotations

import json
import signal
import time
from urllib.parse import urlsplit

import pytest
import redis

from rlmesh.queue import RunKeys
from rlmesh.v1 import trajectory_pb2
from tests.support.jobs import Job, make_files, private_redis_url
from tests.support.monitoring import (
    ALERTS,
    Prometheus,
    alert_rules,
    has_data,
    panel_queries,
    scrape_config,
    selecting_expr,
)
from tests.support.polling import wait_until
from tests.support.repo import CPU_DEMO

STEPS = 100_000  # far more than the test waits for (a step takes under a second): it stops the run
RUN_ID = "monitoring"
DATA_WITHIN_S = 60  # from Prometheus' first scrape until every query has had data

# Queries that cannot have data in a short healthy run on CPUs, and why. Keep it short.
NO_DATA_HERE = {
    ("Tokens/s per GPU while generating", "A"): "the run's replicas compute on the CPU: no GPU to divide by",
    ("Control plane", "B"): "a healthy run takes no control action (pause, set_hyperparam, ...)",
}
# Alerts whose expression without its threshold still needs what a short run lacks, and the probe
# checked instead: the series the rule reads.
PROBES = {
    "RLMeshLearnerStalled": (
        "rlmesh_learner_training_global_step",
        "its `offset 30m` needs half an hour of history",
    ),
}


def overrides(tmp_path) -> list[str]:
    files = make_files(tmp_path / "files")
    return [
        f"actor_rollout_ref.model.path={files.model}",
        f"data.train_files={files.train}",
        f"data.val_files={files.val}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"trainer.total_training_steps={STEPS}",
        f"rlmesh.run_id={RUN_ID}",
        "trainer.save_freq=-1",
        "trainer.test_freq=2",
        "trainer.val_before_train=true",
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "critic.ppo_micro_batch_size_per_gpu=16",
        # Every panel's series: a critic (gae, the demo's), KL in the reward and as a loss, a
        # reference service rather than the demo's colocated one, one replica.
        "actor_rollout_ref.actor.use_kl_loss=true",
        "rlmesh.reference.colocated=false",
        "rlmesh.rollout.replicas=1",
        "rlmesh.sampler.tasks_in_flight=4",
    ]


def scrape_targets(service_dir) -> dict[str, list[str]]:
    """Job name -> metrics address of every service the job started, from their ready files
    (rollout-0, rollout-1, ... are one job, as compose's replicas are)."""
    targets: dict[str, list[str]] = {}
    for ready in sorted(service_dir.glob("*.ready.json")):
        port = json.loads(ready.read_text()).get("metrics_port")
        if port:
            service = ready.name.removesuffix(".ready.json").split("-")[0]
            targets.setdefault(f"rlmesh-{service}", []).append(f"127.0.0.1:{port}")
    return targets


def engine_targets(redis_url: str) -> list[str]:
    """The address of every registered replica's engine (compose scrapes them as rlmesh-engine)."""
    keys = RunKeys(RUN_ID)
    client = redis.Redis.from_url(redis_url)
    try:
        ids = sorted(client.smembers(keys.replicas))
        values = client.mget([keys.replica(i.decode()) for i in ids]) if ids else []
    finally:
        client.close()
    registrations = [trajectory_pb2.ReplicaRegistration.FromString(v) for v in values if v]
    return [urlsplit(r.engine_url).netloc for r in registrations]


def wait_for_data(prom: Prometheus, queries: dict[str, str], timeout_s: float) -> dict[str, str]:
    """Polls every query until each has returned data once; returns those that never did, with
    their last result."""
    missing = dict(queries)
    last: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while missing and time.monotonic() < deadline:
        for name, expr in list(missing.items()):
            result = prom.query(expr)
            if has_data(result):
                del missing[name]
            last[name] = json.dumps(result)[:200]
        time.sleep(1)
    return {name: f"{expr}\n    last result: {last.get(name)}" for name, expr in missing.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_panel_and_alert_query_has_data_from_a_real_run(tmp_path):
    # The exceptions stay honest: each names a query or an alert that exists.
    known = {(q.panel, q.ref_id) for q in panel_queries()}
    assert set(NO_DATA_HERE) <= known, (
        f"NO_DATA_HERE names queries that are gone: {set(NO_DATA_HERE) - known}"
    )
    assert set(PROBES) <= {r["alert"] for r in alert_rules()}, "PROBES names an alert that is gone"
    panel_exprs = {
        f"panel {q.panel!r} {q.ref_id}": q.expr
        for q in panel_queries()
        if (q.panel, q.ref_id) not in NO_DATA_HERE
    }
    alert_exprs = {
        f"alert {r['alert']}": PROBES.get(r["alert"], (selecting_expr(r["expr"]),))[0] for r in alert_rules()
    }
    job = Job.start(["-c", str(CPU_DEMO), *overrides(tmp_path)])
    try:
        job.wait_for(r"^\[train\] control ", timeout_s=300)
        printed = job.wait_for(r"^\[train\] redis +(redis://\S+)", 1)[1]
        redis_url = private_redis_url(tmp_path / "run" / "services" / RUN_ID, printed)
        targets: dict[str, list[str]] = {}

        def every_service_up() -> bool:
            # The services start side by side: a replica registers (and writes its ready file)
            # once its engine has loaded, which may be after the control plane is up.
            targets.clear()
            targets.update(scrape_targets(tmp_path / "run" / "services" / RUN_ID))
            targets["rlmesh-engine"] = engine_targets(redis_url)
            return all(
                targets.get(f"rlmesh-{s}")
                for s in ("learner", "rollout", "reward", "reference", "engine", "control")
            )

        wait_until(every_service_up, 180, "every service's metrics address", every_s=0.5)
        with Prometheus(tmp_path / "prometheus", scrape_config(targets, [ALERTS])) as prom:
            prom.wait_ready()
            # The rules file loaded and evaluated: the watchdog fires on the first evaluation.
            missing = wait_for_data(
                prom, {"every target up": 'min(up{job=~"rlmesh-.*"}) == 1', "rules evaluated": "ALERTS"}, 30
            )
            assert not missing, (
                f"Prometheus does not scrape or evaluate:\n{missing}\n{prom.targets()}\n{prom.log_tail()}"
            )
            missing = wait_for_data(prom, {**panel_exprs, **alert_exprs}, DATA_WITHIN_S)
        assert not missing, (
            f"{len(missing)} queries returned no data from a live run within {DATA_WITHIN_S} s "
            "(a metric renamed or never exported?):\n" + "\n".join(f"  {k}: {v}" for k, v in missing.items())
        )
    finally:
        job.proc.send_signal(signal.SIGINT)  # stops every service it started
        job.finish(timeout_s=120)
