"""The autoscaler end to end on simulated engines (tests/support/autoscale.py): a step up in the
tasks arriving and the fleet grows, the load gone and it shrinks back to its floor by draining,
and every task put comes back exactly once as all its samples. The phases' deadlines are the
bounds this test states; ``make bench-autoscale`` measures how long following takes."""

from __future__ import annotations

from rlmesh.runtime.health import scrape_metrics
from tests.support.autoscale import AUTOSCALE_SPEC, FleetUnderLoad, Phase, control_get
from tests.support.jobs import metric_sum

# AUTOSCALE_SPEC: a replica of two slots finishes about 1.2 tasks a second, so 0.3 tasks/s needs
# one replica and 2.5 tasks/s three or four (at 80% of their slots).
MAX = 4


def test_a_step_in_load_grows_the_fleet_and_its_end_shrinks_it_with_nothing_lost(tmp_path):
    with FleetUnderLoad(tmp_path, AUTOSCALE_SPEC, min_replicas=1, max_replicas=MAX) as fleet:
        result = fleet.drive(
            [
                Phase("low", tasks_per_s=0.3, seconds=10),
                Phase(
                    "high",
                    tasks_per_s=2.5,
                    until=lambda s: s.replicas >= 3,
                    what="3 replicas or more running",
                    deadline_s=150,
                    hold_s=5,
                ),
                Phase(
                    "none",
                    tasks_per_s=0.0,
                    until=lambda s: s.outstanding == 0 and s.replicas == 1 and s.settled,
                    what="every task done and the fleet back at 1 replica",
                    deadline_s=150,
                ),
            ]
        )
        for s in result.samples:
            print(s)
        low = [s for s in result.samples if s.phase == "low"]
        assert max(s.replicas for s in low) == 1, "the fleet grew at the low load"
        assert result.audit() == [], "\n".join(result.audit())
        assert len(result.put) > 20
        added, stopped = fleet.fleet.added, fleet.fleet.stopped
        assert len(added) >= 2 and len(stopped) == len(added)
        assert all(code == 0 for _, code in stopped), f"a replica did not drain and stop cleanly: {stopped}"
        audit = control_get(fleet, "/api/v1/audit?action=scale_replicas&limit=100")["entries"]
        ups = [e for e in audit if e["new"] > e["old"]]
        downs = [e for e in audit if e["new"] < e["old"]]
        assert ups and downs, f"the audit log lacks a rise or a fall: {audit}"
        assert all(e["who"] == "autoscaler" and e["source"] == "auto" and e["detail"] for e in audit)
        scraped = scrape_metrics("127.0.0.1", fleet.control.metrics_port)
        assert metric_sum(scraped, "rlmesh_autoscale_desired_replicas") == 1
        assert metric_sum(scraped, "rlmesh_autoscale_changes_total", direction="up") >= 1
        assert metric_sum(scraped, "rlmesh_autoscale_changes_total", direction="down") >= 1
        view = control_get(fleet, "/api/v1/autoscale")
        assert view["settings"]["max_replicas"] == MAX
        assert view["last"]["desired"] == 1 and view["last"]["replica_tasks_per_s"] > 0
