"""The HTTP guard's decisions from a request's headers alone (the engine and the control plane run
it; their servers are tested under tests/integration): which Host, Origin and Content-Type pass,
the body declared too large, and the API pages' CSP, which must name their own inline script."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rlmesh.runtime.http_guard import (
    GuardPolicy,
    docs_csp,
    guard_policy,
    host_name,
    http_limits,
    refusal,
)

LIMIT = 1000


def policy(**kw) -> GuardPolicy:
    return guard_policy(**{"own_hosts": ["0.0.0.0", "gpu-7.lab:8000"], "max_body_bytes": LIMIT, **kw})


def scope(method: str = "GET", **headers: str) -> dict:
    raw = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http", "method": method, "scheme": "http", "path": "/x", "headers": raw}


@pytest.mark.parametrize(
    ("value", "name"),
    [("[::1]:80", "::1"), ("Control:8000", "control"), ("::", "::"), ("example.org.", "example.org")],
)
def test_host_name_drops_port_brackets_case_and_the_root_dot(value, name):
    assert host_name(value) == name


@pytest.mark.parametrize(
    "host", ["127.0.0.1:30000", "localhost:8000", "[::1]:8000", "10.0.0.5", "gpu-7.lab", "GPU-7.LAB:1"]
)
def test_loopback_ip_literals_and_own_names_pass(host):
    assert refusal(policy(), scope(host=host)) is None


@pytest.mark.parametrize("host", ["evil.example", "localhost.evil.example", "gpu-7.lab.evil.example:80"])
def test_another_name_is_a_421_naming_the_setting(host):
    status, why = refusal(policy(), scope(host=host))
    assert status == 421 and repr(host) in why and "rlmesh.security.allowed_hosts" in why


def test_allowed_hosts_and_the_wildcard():
    assert refusal(policy(allowed_hosts=["control"]), scope(host="control:8000")) is None
    assert refusal(policy(allowed_hosts=["*"]), scope(host="anything.example")) is None
    assert refusal(policy(allowed_hosts=["control"]), scope(host="controls")) is not None


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_a_state_change_from_another_origin_is_a_403(method):
    req = scope(method, host="127.0.0.1:8000", origin="http://evil.example")
    status, why = refusal(policy(), req)
    assert status == 403 and "http://evil.example" in why and method in why
    # The same request from the page the service served, or without a browser, passes.
    assert refusal(policy(), scope(method, host="127.0.0.1:8000", origin="http://127.0.0.1:8000")) is None
    assert refusal(policy(), scope(method, host="127.0.0.1:8000")) is None


def test_origin_null_another_port_or_scheme_is_not_the_services_own():
    for origin in ("null", "http://127.0.0.1:9999", "https://127.0.0.1:8000"):
        assert refusal(policy(), scope("POST", host="127.0.0.1:8000", origin=origin))[0] == 403, origin


def test_allowed_origins_and_reads_from_anywhere():
    req = scope("POST", host="127.0.0.1:8000", origin="https://ops.example")
    assert refusal(policy(allowed_origins=["https://OPS.example/"]), req) is None
    assert refusal(policy(allowed_origins=["*"]), req) is None
    # A read sends nothing; the browser keeps its answer from the other page (no CORS headers).
    assert refusal(policy(), scope("GET", host="127.0.0.1", origin="http://evil.example")) is None


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_form_body_is_a_415(content_type):
    req = scope("POST", host="127.0.0.1", content_type=content_type, content_length="3")
    status, why = refusal(policy(), req)
    assert status == 415 and content_type in why


def test_json_passes_and_a_bare_body_only_where_json_is_not_required():
    for ct in ("application/json", "Application/JSON; charset=utf-8", "application/merge-patch+json"):
        assert (
            refusal(policy(), scope("PATCH", host="127.0.0.1", content_type=ct, content_length="2")) is None
        )
    bare = scope("POST", host="127.0.0.1", content_length="2")
    assert refusal(policy(), bare) is None  # the engine: SGLang reads such a body as JSON
    assert refusal(policy(json_bodies_only=True), bare)[0] == 415
    chunked = scope("POST", host="127.0.0.1", transfer_encoding="chunked")
    assert refusal(policy(json_bodies_only=True), chunked)[0] == 415
    # No body at all (curl -X POST .../run/pause) is no form.
    assert refusal(policy(json_bodies_only=True), scope("POST", host="127.0.0.1", content_length="0")) is None
    assert refusal(policy(json_bodies_only=True), scope("POST", host="127.0.0.1")) is None


def test_a_body_declared_past_the_limit_is_a_413_for_any_method():
    for method in ("GET", "POST"):
        status, why = refusal(policy(), scope(method, host="127.0.0.1", content_length=str(LIMIT + 1)))
        assert status == 413 and f"at most {LIMIT}" in why
    assert refusal(policy(), scope("POST", host="127.0.0.1", content_length=str(LIMIT))) is None


def test_the_api_pages_csp_allows_their_inline_script_by_its_hash():
    page = TestClient(FastAPI()).get("/docs").content
    scripts = re.findall(rb"<script>(.*?)</script>", page, re.DOTALL)
    assert scripts  # FastAPI starts Swagger UI inline
    csp = docs_csp(page)
    for script in scripts:
        assert f"'sha256-{base64.b64encode(hashlib.sha256(script).digest()).decode()}'" in csp
    assert "'unsafe-inline'" not in csp.split("script-src", 1)[1].split(";", 1)[0]
    assert "frame-ancestors 'none'" in csp


def test_uvicorn_limits_let_exactly_max_concurrency_through():
    assert http_limits(256, 5.0) == {"limit_concurrency": 257, "timeout_keep_alive": 5.0}
    with pytest.raises(ValueError):
        http_limits(0, 5.0)
