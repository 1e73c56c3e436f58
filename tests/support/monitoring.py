"""The monitoring files as the tests read them (deploy/alerts.yml, the Grafana dashboard), the
queries they make, and a real Prometheus process on loopback for a test to scrape services with.

docs/monitoring.md"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlmesh.runtime.net import free_port
from tests.support.repo import REPO

ALERTS = REPO / "deploy" / "alerts.yml"
ALERTS_TESTS = REPO / "deploy" / "alerts.test.yml"
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "rlmesh-run.json"
MONITORING_DOC = REPO / "docs" / "monitoring.md"

# Grafana's variables, as a test substitutes them: every replica, a rate window of a few scrapes.
VARIABLES = {"replica": ".*", "__rate_interval": "1m", "__interval": "15s", "__range": "5m"}
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(__\w+|[A-Za-z]\w*)")

# Straight to addresses of this machine (Prometheus, containers, Ray nodes), whatever proxy the
# environment names.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# A comparison with a number, as an alert's threshold is written (`> 0.03`, `== 0`, `< bool 5`).
THRESHOLD = re.compile(
    r"\s*(?:==|!=|>=|<=|>|<)\s*(?:bool\s+)?[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?![\w.\[])"
)


def binary(name: str) -> str:
    """The path of Debian's ``prometheus`` package's ``name`` (promtool, prometheus); fails saying
    how to get it, never skips: `make test` installs the package."""
    path = shutil.which(name)
    assert path, (
        f"{name} is not installed: it comes with Debian's prometheus package, which `make test` "
        "installs (or: sudo apt-get install prometheus)"
    )
    return path


# ---------------------------------------------------------------- the alert rules


def alert_rules() -> list[dict]:
    """Every alerting rule of deploy/alerts.yml, each with its group's name under ``group``."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [
        {**rule, "group": group["name"]} for group in groups for rule in group["rules"] if "alert" in rule
    ]


def selecting_expr(expr: str) -> str:
    """An alert's expression without its comparisons with a number: what it selects and computes,
    which returns data whether or not the alert fires."""
    return THRESHOLD.sub("", expr).strip()


# ---------------------------------------------------------------- the dashboard


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref_id: str
    expr: str  # with the dashboard's variables substituted


def substitute(expr: str) -> str:
    """``expr`` with Grafana's variables replaced as in ``VARIABLES``; others (``$1`` of a
    ``label_replace``) are not variables and stay."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return VARIABLES.get(name, match.group(0))

    return VARIABLE.sub(one, expr)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict | None = None) -> list[dict]:
    """Every panel that is not a row, rows' collapsed panels included."""
    out = []
    for panel in (board or dashboard())["panels"]:
        if panel["type"] == "row":
            out += panel.get("panels", [])
        else:
            out.append(panel)
    return out


def panel_queries(board: dict | None = None) -> list[PanelQuery]:
    return [
        PanelQuery(panel["title"], target["refId"], substitute(target["expr"]))
        for panel in panels(board)
        for target in panel.get("targets", [])
    ]


# ---------------------------------------------------------------- a real Prometheus


def scrape_config(targets: dict[str, list[str]], rule_files: list[Path], interval_s: int = 1) -> dict:
    """A Prometheus configuration scraping ``targets`` (job name -> host:port list) every
    ``interval_s`` and evaluating ``rule_files`` as often."""
    return {
        "global": {
            "scrape_interval": f"{interval_s}s",
            "scrape_timeout": f"{interval_s}s",
            "evaluation_interval": f"{interval_s}s",
        },
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": hosts}]}
            for job, hosts in sorted(targets.items())
        ],
    }


class Prometheus:
    """``prometheus`` on a free loopback port with its own config and storage in ``workdir``."""

    def __init__(self, workdir: Path, config: dict) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log_tail()}"
            try:
                with DIRECT.open(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, f"prometheus not ready in {timeout_s} s:\n{self.log_tail()}"
            time.sleep(0.2)

    def targets(self) -> dict[str, str]:
        """Each scrape target (job and address) with its health and last error: why one is down."""
        with DIRECT.open(f"{self.url}/api/v1/targets", timeout=10) as resp:
            active = json.loads(resp.read())["data"]["activeTargets"]
        return {f"{t['labels']['job']} {t['scrapeUrl']}": f"{t['health']} {t['lastError']}" for t in active}

    def query(self, expr: str) -> list[dict]:
        """The result of an instant query now; fails naming the query when Prometheus refuses it."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with DIRECT.open(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as e:  # 400 / 422: a query it cannot parse or run
            raise AssertionError(f"prometheus refused {expr!r}: {e.read().decode(errors='replace')}") from e
        assert body["status"] == "success", f"{expr!r}: {body}"
        return body["data"]["result"]


def has_data(result: list[dict]) -> bool:
    """At least one series with a number (NaN, as 0/0 gives, is no data)."""
    for series in result:
        value = series.get("value", [None, "NaN"])[1]
        if not math.isnan(float(value)):
            return True
    return False
