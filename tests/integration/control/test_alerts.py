"""``GET /api/v1/alerts``: the pending and firing alerts of the Prometheus the control plane is
given (a real ``prometheus`` evaluating a rule that always fires), a 503 naming it when it does not
answer, and "none" when no Prometheus is configured."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from rlmesh.job.stack import free_port_overrides
from rlmesh.runtime.launcher import ProcessLauncher
from tests.support.control import AUTH, TOKEN
from tests.support.monitoring import Prometheus, scrape_config
from tests.support.polling import wait_until
from tests.support.repo import CPU_DEMO


def start_control(launcher: ProcessLauncher, redis_url: str, extra: list[str]) -> str:
    # No learner: the alerts route reads Prometheus only (the learner's address is never dialled).
    control = launcher.start_service(
        "control",
        config_path=CPU_DEMO,
        overrides=[
            "rlmesh.run_id=alerts-test",
            f"rlmesh.redis_url={redis_url}",
            f"rlmesh.auth_token={TOKEN}",
            "rlmesh.learner.addresses=['127.0.0.1:1']",
            *free_port_overrides("control"),
            *extra,
        ],
        timeout_s=60,
    )
    return f"http://{control.grpc_address}"


def test_the_alerts_of_the_runs_prometheus_are_listed(tmp_path: Path):
    rules = tmp_path / "rules.yml"
    rules.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "test",
                        "rules": [
                            {
                                "alert": "RLMeshAlwaysFiring",
                                "expr": "vector(1) > 0",
                                "labels": {"severity": "warning"},
                                "annotations": {"summary": "a rule that always fires"},
                            }
                        ],
                    }
                ]
            }
        )
    )
    with ProcessLauncher(tmp_path / "services", stop_grace_s=10) as launcher:
        redis = launcher.start_redis()
        with Prometheus(tmp_path / "prometheus", scrape_config({}, [rules])) as prometheus:
            prometheus.wait_ready()
            url = start_control(launcher, redis.url, [f"rlmesh.control.prometheus_url={prometheus.url}"])
            with httpx.Client(base_url=url, headers=AUTH, timeout=30) as api:
                assert api.get("/api/v1/alerts", headers={"Authorization": ""}).status_code == 401

                def listed() -> list[dict]:
                    return api.get("/api/v1/alerts").json()["alerts"]

                wait_until(lambda: any(a["state"] == "firing" for a in listed()), 60, "the rule to fire", 0.5)
                (alert,) = listed()
                assert alert["name"] == "RLMeshAlwaysFiring" and alert["severity"] == "warning"
                assert alert["summary"] == "a rule that always fires"
                assert api.get("/api/v1/alerts").json()["source"] == prometheus.url
            prometheus.stop()
            with httpx.Client(base_url=url, headers=AUTH, timeout=30) as api:
                r = api.get("/api/v1/alerts")
                assert r.status_code == 503 and prometheus.url in r.json()["detail"]
        plain = start_control(launcher, redis.url, [])
        with httpx.Client(base_url=plain, headers=AUTH, timeout=30) as api:
            assert api.get("/api/v1/alerts").json() == {"source": "none", "alerts": []}
