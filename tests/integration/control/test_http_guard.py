"""The control plane's HTTP guard against real parts: ``rlmesh serve control`` in front of a real
learner (tests/support/control.py), given one allowed host name and origin and a concurrency limit.
A Host that is not the plane's gets a 421, a change from another site's page a 403 (Origin) or a
415 (an HTML form's body), a body past 1 MiB a 413 from its headers or as it streams in, a NaN a
422 naming the field, requests past the limit a 503; the metric labels stay a fixed set whatever
is sent; every answer carries the security headers, and the dashboard runs in a real Chromium
under its CSP, which the browser enforces."""

from __future__ import annotations

import asyncio
import re
import uuid

import httpx
import pytest

from rlmesh.control.app import MAX_BODY_BYTES
from rlmesh.control.metrics import METHODS, OTHER
from rlmesh.queue import RunKeys, connect
from rlmesh.queue.run_info import publish_step_metrics
from rlmesh.runtime.launcher import ProcessLauncher
from tests.support.browser import Browser, chromium_path
from tests.support.control import AUTH, TOKEN, start_control_stack
from tests.support.polling import wait_until
from tests.support.raw_http import chunked_unfinished, declared_only, held_connections

ALLOWED_HOST = "control.lab"
ALLOWED_ORIGIN = "https://ops.example"
MAX_CONCURRENCY = 4
JSON = {"Content-Type": "application/json"}
HEADERS = {"x-frame-options": "DENY", "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}
# Records each CSP violation the page reports, from before its first script runs.
CSP_PROBE = (
    "window.__csp = []; document.addEventListener('securitypolicyviolation', "
    "(e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("control"), stop_grace_s=10) as launcher:
        yield start_control_stack(
            launcher,
            tmp_path_factory.mktemp("files"),
            control_extra=[
                f"rlmesh.security.allowed_hosts=['{ALLOWED_HOST}']",
                f"rlmesh.security.allowed_origins=['{ALLOWED_ORIGIN}']",
                f"rlmesh.security.http_max_concurrency={MAX_CONCURRENCY}",
            ],
        )


def call(stack, method, path, *, host=None, token=True, **kw):
    headers = {**(AUTH if token else {}), **kw.pop("headers", {}), **({"Host": host} if host else {})}
    return httpx.request(method, stack.url + path, headers=headers, timeout=60, **kw)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/dashboard/", "/api/v1/run/status", "/docs"])
def test_a_host_not_the_planes_is_a_421(stack, path):
    r = call(stack, "GET", path, host="rebind.evil.example:8000")
    assert r.status_code == 421, r.text
    assert "'rebind.evil.example:8000'" in r.json()["detail"]
    assert "rlmesh.security.allowed_hosts" in r.json()["detail"]


@pytest.mark.parametrize("host", [ALLOWED_HOST, f"{ALLOWED_HOST}:8000", "localhost:8000", "127.0.0.1"])
def test_loopback_ip_literals_and_allowed_names_are_served(stack, host):
    assert call(stack, "GET", "/health", host=host).status_code == 200
    assert call(stack, "GET", "/api/v1/run/status", host=host).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/api/v1/run/pause", None),
        ("POST", "/api/v1/run/stop", {"checkpoint": False}),
        ("PATCH", "/api/v1/hyperparams", {"kl_coef": 0.01}),
        ("POST", "/api/v1/replicas/r-1/drain", {}),
        ("DELETE", "/api/v1/rewards/127.0.0.1:1", None),
        ("POST", "/api/v1/dead-letters/1-1/replay", None),
    ],
)
def test_a_change_from_another_origin_is_a_403_and_changes_nothing(stack, method, path, body):
    audited = len(call(stack, "GET", "/api/v1/audit").json()["entries"])
    for origin in ("https://evil.example", "null", stack.url.replace("127.0.0.1", "localhost")):
        r = call(stack, method, path, json=body, headers={"Origin": origin})
        assert r.status_code == 403, (origin, r.text)
        assert repr(origin) in r.json()["detail"] and "rlmesh.security.allowed_origins" in r.json()["detail"]
    assert len(call(stack, "GET", "/api/v1/audit").json()["entries"]) == audited
    assert call(stack, "GET", "/api/v1/run/status").json()["paused"] is False


def test_the_planes_own_page_and_an_allowed_origin_may_change_state(stack):
    for origin in (stack.url, ALLOWED_ORIGIN):
        r = call(stack, "PATCH", "/api/v1/hyperparams", json={"kl_coef": 0.01}, headers={"Origin": origin})
        assert r.status_code == 200, (origin, r.text)


@pytest.mark.parametrize(
    ("content_type", "content"),
    [
        ("text/plain", b'{"checkpoint": false}'),
        ("application/x-www-form-urlencoded", b"checkpoint=false"),
        ("multipart/form-data; boundary=b", b"--b--"),
        (None, b'{"checkpoint": false}'),  # a body that says nothing of its type
    ],
)
def test_a_change_whose_body_is_not_json_is_a_415(stack, content_type, content):
    headers = {"Content-Type": content_type} if content_type else {}
    for token in (False, True):
        r = call(stack, "POST", "/api/v1/run/stop", token=token, content=content, headers=headers)
        assert r.status_code == 415, r.text
        assert "application/json" in r.json()["detail"]
    assert call(stack, "GET", "/api/v1/run/status").json()["phase"] != "stopping"


def test_a_change_with_no_body_needs_no_content_type(stack):
    """``rlmesh ctl pause`` and ``curl -X POST``: nothing a form could send."""
    assert call(stack, "POST", "/api/v1/run/pause").json()["paused"] is True
    assert call(stack, "POST", "/api/v1/run/resume").json()["paused"] is False


@pytest.mark.parametrize(
    "literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b'"nan"', b'"inf"', b'"-Infinity"']
)
@pytest.mark.parametrize("field", ["actor_lr", "kl_coef", "top_p"])
def test_a_non_finite_hyperparameter_is_a_422_naming_it(stack, field, literal):
    r = call(
        stack, "PATCH", "/api/v1/hyperparams", content=b'{"%s": %s}' % (field.encode(), literal), headers=JSON
    )
    assert r.status_code == 422, r.text
    [error] = r.json()["detail"]
    assert error["loc"] == ["body", field] and "finite" in error["msg"]


def test_a_nan_anywhere_in_a_body_is_a_422(stack):
    r = call(stack, "POST", "/api/v1/replicas/r-1/drain", content=b'{"timeout_s": NaN}', headers=JSON)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "timeout_s"]
    r = call(stack, "PATCH", "/api/v1/hyperparams", content=b'{"actor_lr": 1e-5, "nope": NaN}', headers=JSON)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "nope"]


def test_every_answer_carries_the_security_headers(stack):
    answers = [
        call(stack, "GET", "/health"),
        call(stack, "GET", "/dashboard/", token=False),
        call(stack, "GET", "/dashboard/dashboard.js", token=False),
        call(stack, "GET", "/api/v1/run/status"),
        call(stack, "GET", "/api/v1/run/status", token=False),  # 401
        call(stack, "GET", "/no-such-page"),
        call(stack, "GET", "/health", host="evil.example"),
        call(stack, "PATCH", "/api/v1/hyperparams", json={"top_p": 7}),  # 422
    ]
    assert [r.status_code for r in answers] == [200, 200, 200, 200, 401, 404, 421, 422]
    for r in answers:
        for name, value in HEADERS.items():
            assert r.headers[name] == value, (r.request.url, name)
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, r.request.url
    docs = call(stack, "GET", "/docs")
    assert docs.status_code == 200
    assert "script-src https://cdn.jsdelivr.net 'sha256-" in docs.headers["content-security-policy"]


def test_a_body_past_the_limit_is_a_413_declared_or_streamed(stack):
    headers = {"Host": "127.0.0.1", **AUTH, **JSON}
    webhook = "/api/v1/alerts/webhook"  # a POST that reads its body, and changes nothing here
    answer = declared_only(stack.url, webhook, MAX_BODY_BYTES + 1, headers)
    assert answer.status == 413 and f"at most {MAX_BODY_BYTES}".encode() in answer.body
    answer = chunked_unfinished(stack.url, webhook, MAX_BODY_BYTES + 1, headers, chunk=1 << 16)
    assert answer.status == 413 and f"over {MAX_BODY_BYTES} bytes".encode() in answer.body
    assert answer.headers["x-frame-options"] == "DENY"
    # At the limit the body is read to its end.
    body = b'{"alerts": []' + b" " * (MAX_BODY_BYTES - 14) + b"}"
    assert len(body) == MAX_BODY_BYTES
    r = call(stack, "POST", webhook, content=body, headers=JSON)
    assert r.status_code == 200 and r.json()["firing"] == []


def request_series(stack) -> set[tuple[str, str]]:
    text = call(stack, "GET", "/metrics").text
    found = re.findall(r'^rlmesh_control_requests_total\{method="([^"]*)",route="([^"]*)"', text, re.M)
    return set(found)


def test_metric_labels_come_from_a_fixed_set_whatever_is_sent(stack):
    def junk() -> None:
        word = uuid.uuid4().hex[:8]
        for method in ("GET", "POST", f"X{word.upper()}", "PROPFIND"):
            for path in (f"/{word}", f"/api/v1/{word}", f"/dashboard/{word}", f"/api/v1/replicas/{word}"):
                call(stack, method, path)
        call(stack, "GET", "/health", host=f"{word}.evil.example")

    request_series(stack)  # a scrape counts too: its own series exists from here on
    junk()
    before = request_series(stack)
    junk()
    assert request_series(stack) == before  # new paths and methods: no new series
    methods = {m for m, _ in before}
    routes = {r for _, r in before}
    assert methods <= METHODS | {OTHER} and OTHER in methods
    assert OTHER in routes and "/api/v1/replicas/{replica_id}" in routes
    assert all(r == OTHER or (r.startswith("/") and "evil" not in r) for r in routes), routes


def test_requests_past_the_concurrency_limit_get_a_503(stack):
    with held_connections(stack.url, "127.0.0.1", MAX_CONCURRENCY + 1) as statuses:
        # Connections the earlier tests closed may still count for a moment: a 503 comes by the
        # (limit + 1)th connection at the latest, never after more than the limit were served.
        assert statuses[-1] == 503 and set(statuses[:-1]) == {200}, statuses
    wait_until(lambda: call(stack, "GET", "/health").status_code == 200, 30, "the plane to serve again")


async def publish_steps(stack, steps: int) -> None:
    redis = connect(stack.redis_url)
    try:
        for step in range(1, steps + 1):
            metrics = {"critic/score/mean": 0.1 * step, "actor/kl_loss": 0.01, "timing_s/step": 1.0}
            await publish_step_metrics(redis, RunKeys(stack.run_id), step, metrics, maxlen=100)
    finally:
        await redis.aclose()


@pytest.mark.timeout(300)
def test_the_dashboard_runs_under_its_csp_and_the_browser_enforces_it(stack, tmp_path):
    chromium_path()
    asyncio.run(publish_steps(stack, 5))
    with Browser(tmp_path / "chromium") as browser:
        browser.command("Page.enable")
        browser.command("Page.addScriptToEvaluateOnNewDocument", source=CSP_PROBE)
        browser.goto(f"{stack.url}/dashboard/?poll_ms=500")
        browser.wait_js("!document.querySelector('#token-form').hidden", 60, "the page to ask for the token")
        browser.js(f"document.querySelector('#token').value = {TOKEN!r}")
        browser.js("document.querySelector('#token-form').requestSubmit()")
        browser.wait_js("Number(document.body.dataset.polls) >= 2", 60, "two polls of the API")
        browser.wait_js(
            "document.querySelector('[data-chart=reward]').dataset.points >= 5", 60, "a chart drawn"
        )
        assert browser.js("typeof uPlot") == "function"
        assert browser.js("document.querySelectorAll('#hparams tbody tr').length") >= 5
        assert browser.js("window.__csp") == []
        # The policy is in force: a script the page did not load from its origin does not run.
        browser.js(
            "document.body.append(Object.assign(document.createElement('script'), "
            "{textContent: 'window.__ran = true'}))"
        )
        browser.wait_js("window.__csp.length > 0", 30, "the violation report")
        assert browser.js("window.__ran") is None
        assert browser.js("window.__csp[0]").startswith("script-src")
