"""What the dashboard opens and what it leaves guarded: with a token, the page and each of its files
answer without it, the API and any other path under ``/dashboard`` do not, and the redirects keep
the page's settings; and the page needs nothing its CSP (``default-src 'self'``) refuses. The app
is built without its lifespan: no Redis, no learner."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from rlmesh.config import load_config
from rlmesh.control import create_app
from rlmesh.control.dashboard import STATIC, open_paths
from tests.support.repo import CPU_DEMO


@pytest.fixture
def client() -> TestClient:
    # On loopback, as a browser reaches it (TestClient's own "testserver" is no name it answers to).
    app = create_app(load_config(str(CPU_DEMO), ["rlmesh.auth_token=secret"]))
    return TestClient(app, base_url="http://127.0.0.1:8000")


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


def test_the_page_needs_nothing_its_csp_refuses(client):
    """No inline script, style or handler, nothing from another origin: what a browser would block
    under ``default-src 'self'``, read from the files themselves."""
    page = client.get("/dashboard/")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    html = page.text
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "an inline script"
    assert not re.search(r"<style\b|\sstyle=|\son[a-z]+=", html), "an inline style or handler"
    for ref in re.findall(r'(?:src|href)="([^"]+)"', html):
        assert "//" not in ref and not ref.startswith("data:"), ref
    for script in ("dashboard.js", "vendor/uPlot.iife.min.js"):  # styles set through CSSOM pass
        js = client.get(f"/dashboard/{script}").text
        assert not re.search(r"\beval\(|new Function\(|setAttribute\(\"style|[{,]\s*style:", js), script
    assert "url(" not in client.get("/dashboard/dashboard.css").text
