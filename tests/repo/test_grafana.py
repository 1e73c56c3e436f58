"""deploy/grafana/: the dashboard is well-formed Grafana JSON whose every query is valid PromQL (promtool
parses them) and covers what an operator of a run watches; provisioning points Grafana at the compose
stack's Prometheus and at the dashboard. That the queries have data from a real run:
tests/e2e/test_monitoring.py."""

from __future__ import annotations

import subprocess

import yaml

from tests.support.monitoring import (
    DASHBOARD,
    GRAFANA,
    alert_rules,
    binary,
    dashboard,
    panel_queries,
    panels,
    selecting_expr,
)

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# What the dashboard must plot: a metric (or query text) for each thing the run's operator watches.
COVERED = {
    "reward": "rlmesh_learner_critic_score_mean",
    "validation score": "rlmesh_learner_val_score",
    "KL in the reward": "rlmesh_learner_actor_reward_kl_penalty",
    "KL loss": "rlmesh_learner_actor_kl_loss",
    "KL coefficient": "rlmesh_learner_actor_reward_kl_penalty_coeff",
    "grad norm": "rlmesh_learner_actor_grad_norm",
    "entropy": "rlmesh_learner_actor_entropy",
    "step time and phases": "rlmesh_learner_timing_s_",
    "weight push time": "rlmesh_learner_timing_s_push_weights",
    "generation tokens/s per replica": "rlmesh_rollout_generated_tokens_total",
    "queue depth": "rlmesh_queue_length",
    "dead letters": 'stream="dead"',
    "replicas": "rlmesh_replicas_registered",
    "services up": "up{",
    "RPC rate": "rlmesh_rpc_requests_total",
    "RPC latency": "rlmesh_rpc_latency_seconds_bucket",
    "RPC errors": 'code!="OK"',
    "alerts firing": "ALERTS{",
}


def test_panels_are_placed_and_query_the_dashboard_datasource():
    board = dashboard()
    assert board["uid"] and board["title"]
    assert {v["name"] for v in board["templating"]["list"]} >= {"datasource", "replica"}
    all_panels = [*board["panels"], *(p for row in board["panels"] for p in row.get("panels", []))]
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    taken: dict[tuple[int, int], str] = {}
    problems = []
    for panel in all_panels:
        pos = panel["gridPos"]
        if pos["x"] + pos["w"] > 24:
            problems.append(f"{panel['title']}: wider than the 24 columns")
        for cell in (
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        ):
            if cell in taken:
                problems.append(f"{panel['title']} overlaps {taken[cell]}")
                break
            taken[cell] = panel["title"]
    for panel in panels(board):
        if panel.get("datasource") != DATASOURCE:
            problems.append(f"{panel['title']}: datasource is not the dashboard's ${{datasource}}")
        if not panel.get("targets") or not all(t.get("expr", "").strip() for t in panel["targets"]):
            problems.append(f"{panel['title']}: a target without a query")
        if not panel.get("description"):
            problems.append(f"{panel['title']}: no description")
    assert not problems, "\n".join(problems)


def test_every_query_is_valid_promql(tmp_path):
    """promtool parses each panel query and each alert's expression without its threshold (what
    the end-to-end test queries), written as recording rules."""
    exprs = [q.expr for q in panel_queries()] + [selecting_expr(r["expr"]) for r in alert_rules()]
    rules = {
        "groups": [
            {"name": "queries", "rules": [{"record": f"query_{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run(
        [binary("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    listing = "\n".join(f"query_{i}: {e}" for i, e in enumerate(exprs))
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{listing}"


def test_the_dashboard_plots_what_an_operator_watches():
    text = "\n".join(q.expr for q in panel_queries())
    missing = sorted(what for what, needle in COVERED.items() if needle not in text)
    assert not missing, f"{DASHBOARD.relative_to(GRAFANA.parents[1])} plots no {', '.join(missing)}"


def test_provisioning_points_at_prometheus_and_the_dashboard():
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "rlmesh.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    # Compose mounts deploy/grafana/dashboards there (docs/monitoring.md#loading-them).
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/rlmesh"
