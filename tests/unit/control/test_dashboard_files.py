"""What the dashboard opens and what it leaves guarded: with a token, the page and each of its files
answer without it, the API and any other path under ``/dashboard`` do not, and the redirects keep
the page's settings. The app is built without its lifespan: no Redis, no learner."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from rlmesh.config import load_config
from rlmesh.control import create_app
from rlmesh.control.dashboard import STATIC, open_paths
from tests.support.repo import CPU_DEMO


@pytest.fixture
def client() -> TestClient:
    return TestClient(create_app(load_config(str(CPU_DEMO), ["rlmesh.auth_token=secret"])))


def test_the_page_and_its_files_are_open_and_nothing_else_is(client):
    files = [p.relative_to(STATIC).as_posix() for p in STATIC.rglob("*") if p.is_file()]
    assert {"index.html", "dashboard.js", "dashboard.css", "vendor/uPlot.iife.min.js"} <= set(files)
    for name in files:
        assert client.get(f"/dashboard/{name}").status_code == 200, name
    page = client.get("/dashboard/")
    assert page.status_code == 200 and "dashboard.js" in page.text
    for guarded in (
        "/api/v1/run/status",
        "/docs",
        "/openapi.json",
        "/dashboard/../api/v1/audit",
        "/dashboard/x",
    ):
        assert client.get(guarded).status_code == 401, guarded
    assert {"/health", "/metrics"} <= open_paths()


def test_the_root_leads_to_the_page_with_its_query(client):
    for path in ("/", "/dashboard"):
        r = client.get(path, params={"poll_ms": "1000"}, follow_redirects=False)
        assert r.status_code == 307 and r.headers["location"] == "/dashboard/?poll_ms=1000", path
