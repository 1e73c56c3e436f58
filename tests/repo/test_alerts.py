"""deploy/alerts.yml: promtool accepts it and its unit tests pass (deploy/alerts.test.yml), every
alert carries what an operator needs (a severity, a wait, a summary, a description and a runbook
section in docs/monitoring.md), and every alert is tested both firing and silent."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.support.monitoring import ALERTS, ALERTS_TESTS, MONITORING_DOC, alert_rules, binary
from tests.support.repo import REPO, anchors

SEVERITIES = {"critical", "warning", "none"}
ALWAYS_FIRING = {"RLMeshWatchdog"}  # fires by design: no silent case, no wait
LABELS = re.compile(r'(\w+)="([^"]*)"')


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_promtool_accepts_the_rules():
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, f"promtool check rules {ALERTS}:\n{done.stdout}{done.stderr}"


def test_the_rules_unit_tests_pass():
    done = promtool("test", "rules", str(ALERTS_TESTS))
    assert done.returncode == 0, f"promtool test rules {ALERTS_TESTS}:\n{done.stdout}{done.stderr}"


def test_every_alert_says_how_bad_when_and_what_to_do():
    sections = anchors(MONITORING_DOC)
    problems = []
    for rule in alert_rules():
        name, notes = rule["alert"], rule.get("annotations", {})
        if rule.get("labels", {}).get("severity") not in SEVERITIES:
            problems.append(f"{name}: severity label not one of {sorted(SEVERITIES)}")
        if name not in ALWAYS_FIRING and not rule.get("for"):
            problems.append(f"{name}: no `for:` wait")
        for key in ("summary", "description", "runbook"):
            if not notes.get(key):
                problems.append(f"{name}: no {key} annotation")
        if notes.get("runbook") != f"docs/monitoring.md#{name.lower()}":
            problems.append(f"{name}: runbook should be docs/monitoring.md#{name.lower()}")
        if name.lower() not in sections:
            problems.append(f"{name}: docs/monitoring.md has no section for it")
    names = [r["alert"] for r in alert_rules()]
    assert len(names) == len(set(names)), f"an alert name is used twice: {names}"
    assert not problems, "\n".join(problems)


def test_every_alert_is_tested_firing_and_silent():
    """Firing: a case expects it. Silent: a case expects nothing at some time, or feeds a series of a
    job or instance that no expected alert carries."""
    fires: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(ALERTS_TESTS.read_text())["tests"]:
        fed = {
            value
            for s in case.get("input_series", [])
            for value in dict(LABELS.findall(s["series"])).values()
        }
        for check in case.get("alert_rule_test", []):
            name, expected = check["alertname"], check.get("exp_alerts") or []
            if expected:
                fires.add(name)
            carried = {str(v) for alert in expected for v in alert.get("exp_labels", {}).values()}
            if not expected or fed - carried - {name}:
                silent.add(name)
    names = {r["alert"] for r in alert_rules()}
    assert names - fires == set(), f"alerts no test expects to fire: {sorted(names - fires)}"
    assert names - ALWAYS_FIRING - silent == set(), (
        f"alerts no test shows silent: {sorted(names - ALWAYS_FIRING - silent)}"
    )
