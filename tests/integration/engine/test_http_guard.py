"""The engine's HTTP guard, against a real engine process started with a token, one allowed host
name and origin and a concurrency limit: a Host that is not the engine's gets a 421 (the probes
and /metrics included), a state change from another site's page a 403 or a 415, a body past 64 MiB
a 413 from its headers or as it streams in (chunked), requests past the limit a 503; and every
answer carries the security headers."""

from __future__ import annotations

import httpx
import pytest

from rlmesh.engine.protocol import MAX_BODY_BYTES
from tests.support.polling import wait_until
from tests.support.raw_http import chunked_unfinished, declared_only, held_connections

TOKEN = "engine-guard-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ALLOWED_HOST = "engine-3.lab"
ALLOWED_ORIGIN = "https://ops.example"
MAX_CONCURRENCY = 4
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
HEADERS = {
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


@pytest.fixture(scope="module")
def engine(launcher, tiny_model_dir):
    return launcher.start_engine(
        tiny_model_dir,
        name="engine-guard",
        env={"RLMESH_AUTH_TOKEN": TOKEN},
        extra_args=[
            "--allowed-host",
            ALLOWED_HOST,
            "--allowed-origin",
            ALLOWED_ORIGIN,
            "--max-concurrency",
            str(MAX_CONCURRENCY),
        ],
        timeout_s=120,
    )


def call(engine, method, path, *, host=None, **kw):
    headers = {**AUTH, **kw.pop("headers", {}), **({"Host": host} if host else {})}
    return httpx.request(method, engine.url + path, headers=headers, timeout=120, **kw)


def assert_sglang_error(r, status, *pieces):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["code"] == status and body["success"] is False
    for piece in pieces:
        assert piece in body["message"], body


@pytest.mark.parametrize("path", ["/health", "/metrics", "/generate", "/get_model_info"])
def test_a_host_not_the_engines_is_a_421(engine, path):
    r = call(engine, "GET", path, host="rebind.evil.example:30000")
    assert_sglang_error(r, 421, "'rebind.evil.example:30000'", "--allowed-host")


@pytest.mark.parametrize("host", [ALLOWED_HOST, f"{ALLOWED_HOST}:30000", "localhost", "127.0.0.1:1", "[::1]"])
def test_loopback_ip_literals_and_allowed_names_are_served(engine, host):
    assert call(engine, "GET", "/health", host=host).status_code == 200
    assert call(engine, "POST", "/generate", host=host, json=GENERATE).status_code == 200


def test_a_state_change_from_another_origin_is_a_403_before_the_token(engine):
    r = call(engine, "POST", "/generate", json=GENERATE, headers={"Origin": "https://evil.example"})
    assert_sglang_error(r, 403, "'https://evil.example'", "--allowed-origin")
    r = httpx.post(engine.url + "/pause_generation", headers={"Origin": "null"}, timeout=60)
    assert r.status_code == 403  # refused before it is asked for a token
    for origin in (ALLOWED_ORIGIN, engine.url):
        r = call(engine, "POST", "/generate", json=GENERATE, headers={"Origin": origin})
        assert r.status_code == 200, (origin, r.text)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_form_body_is_a_415(engine, content_type):
    r = call(
        engine, "POST", "/generate", content=b'{"input_ids": [1]}', headers={"Content-Type": content_type}
    )
    assert_sglang_error(r, 415, content_type)


def test_every_answer_carries_the_security_headers(engine):
    answers = [
        call(engine, "GET", "/health"),
        call(engine, "POST", "/generate", json=GENERATE),
        httpx.get(engine.url + "/get_model_info", timeout=60),  # 401
        call(engine, "GET", "/no-such-route"),
        call(engine, "GET", "/health", host="evil.example"),
        call(engine, "POST", "/generate", json={"input_ids": []}),  # 400
    ]
    assert [r.status_code for r in answers] == [200, 200, 401, 404, 421, 400]
    for r in answers:
        for name, value in HEADERS.items():
            assert r.headers[name] == value, (r.request.url, name)
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    docs = call(engine, "GET", "/docs")
    assert (
        docs.status_code == 200
        and "script-src https://cdn.jsdelivr.net 'sha256-" in docs.headers["content-security-policy"]
    )


def test_a_body_declared_past_the_limit_is_refused_unread(engine):
    headers = {"Host": "127.0.0.1", **AUTH, "Content-Type": "application/json"}
    answer = declared_only(engine.url, "/generate", 1 << 40, headers)
    assert answer.status == 413 and answer.headers["connection"] == "close"
    assert b"at most 67108864" in answer.body and b"1099511627776 bytes" in answer.body


def test_a_chunked_body_is_stopped_at_the_limit_and_the_engine_serves_on(engine):
    headers = {"Host": "127.0.0.1", **AUTH, "Content-Type": "application/json"}
    answer = chunked_unfinished(engine.url, "/generate", MAX_BODY_BYTES + 1, headers)
    assert answer.status == 413 and b"over 67108864 bytes" in answer.body
    assert answer.headers["x-frame-options"] == "DENY"
    # At the limit exactly, the body is read to its end (and refused as the JSON it is not).
    r = call(engine, "POST", "/generate", content=b" " * (MAX_BODY_BYTES - 2) + b"[]")
    assert_sglang_error(r, 400, "must be a JSON object")
    assert call(engine, "POST", "/generate", json=GENERATE).status_code == 200


def test_requests_past_the_concurrency_limit_get_a_503(engine):
    with held_connections(engine.url, "127.0.0.1", MAX_CONCURRENCY + 1) as statuses:
        # Connections the earlier tests closed may still count for a moment: a 503 comes by the
        # (limit + 1)th connection at the latest, never after more than the limit were served.
        assert statuses[-1] == 503 and set(statuses[:-1]) == {200}, statuses
    wait_until(lambda: call(engine, "GET", "/health").status_code == 200, 30, "the engine to serve again")
