"""The engine's HTTP API behind rlmesh.auth_token, against a real engine process started with it:
every route refuses a request without the token or with a wrong one (401, as SGLang's
``--api-key``), and serves one with it; the probes and /metrics stay open."""

from pathlib import Path

import httpx
import pytest

from rlmesh.engine.app import ROUTES
from rlmesh.engine.client import EngineClient, EngineError
from rlmesh.runtime.http_auth import OPEN_PATHS

TOKEN = "engine-token-5f2c"
# FastAPI's own pages: served by the same app, so behind the same token.
FASTAPI_PAGES = [("/openapi.json", "GET"), ("/docs", "GET"), ("/redoc", "GET")]
GUARDED = sorted(
    {(r.path, m) for r in ROUTES for m in r.methods if r.path not in OPEN_PATHS} | set(FASTAPI_PAGES)
)


@pytest.fixture(scope="module")
def engine(launcher, tiny_model_dir):
    return launcher.start_engine(
        tiny_model_dir, name="engine-token", env={"RLMESH_AUTH_TOKEN": TOKEN}, timeout_s=120
    )


def call(engine, method, path, body=None, headers=None):
    return httpx.request(method, engine.url + path, json=body, headers=headers, timeout=120)


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def test_every_route_the_server_serves_is_covered_here(engine):
    served = set(call(engine, "GET", "/openapi.json", headers=bearer(TOKEN)).json()["paths"])
    assert served == {r.path for r in ROUTES}


@pytest.mark.parametrize("path", sorted(OPEN_PATHS))
def test_probes_and_metrics_answer_without_the_token(engine, path):
    r = call(engine, "GET", path)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("path", "method"), GUARDED)
def test_a_route_refuses_a_request_without_the_token(engine, path, method):
    r = call(engine, method, path, body={})
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {
        "error": "Unauthorized",
        "message": f"{path}: missing 'Authorization: Bearer <token>' header",
    }


@pytest.mark.parametrize(("path", "method"), GUARDED)
@pytest.mark.parametrize(
    "authorization",
    [f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"bearer {TOKEN}", TOKEN, "Bearer", f"Basic {TOKEN}"],
)
def test_a_route_refuses_a_wrong_token(engine, path, method, authorization):
    r = call(engine, method, path, body={}, headers={"Authorization": authorization})
    assert r.status_code == 401, r.text
    assert r.json()["message"] == f"{path}: invalid bearer token"


def authorized_calls(model_dir: Path) -> dict[tuple[str, str], tuple[object, int, str]]:
    """(path, method) -> (body, status, a piece of the answer) of a call with the token; 400 where a
    valid body would act on a weight group (a random init would dial a random address)."""
    info = (None, 200, "")
    return {
        ("/generate", "POST"): (
            {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
            200,
            "output_ids",
        ),
        ("/get_model_info", "GET"): info,
        ("/model_info", "GET"): info,
        ("/get_server_info", "GET"): info,
        ("/server_info", "GET"): info,
        ("/flush_cache", "GET"): info,
        ("/flush_cache", "POST"): info,
        ("/pause_generation", "POST"): ({}, 200, "paused"),
        ("/continue_generation", "POST"): ({}, 200, "continued"),
        ("/abort_request", "POST"): ({"rid": "no-such-request"}, 200, "aborted 0"),
        ("/init_weights_update_group", "POST"): ({}, 400, "master_address"),
        ("/update_weights_from_distributed", "POST"): ({}, 400, "names"),
        ("/destroy_weights_update_group", "POST"): (
            {"group_name": "no-such-group"},
            400,
            "no weight update group",
        ),
        ("/update_weights_from_disk", "POST"): ({"model_path": str(model_dir)}, 200, "Succeeded"),
        ("/get_weights_by_name", "GET"): ({"name": "lm_head.weight", "truncate_size": 2}, 200, "["),
        ("/get_weights_by_name", "POST"): ({"name": "lm_head.weight", "truncate_size": 2}, 200, "["),
        ("/update_weight_version", "POST"): ({"new_version": "v-auth"}, 200, "v-auth"),
        ("/openapi.json", "GET"): info,
        ("/docs", "GET"): info,
        ("/redoc", "GET"): info,
    }


def test_the_table_of_authorized_calls_names_every_guarded_route(tiny_model_dir):
    assert set(authorized_calls(tiny_model_dir)) == set(GUARDED)


@pytest.mark.parametrize(("path", "method"), GUARDED)
def test_a_route_serves_a_request_with_the_token(engine, tiny_model_dir, path, method):
    body, status, answer = authorized_calls(tiny_model_dir)[(path, method)]
    try:
        r = call(engine, method, path, body=body, headers=bearer(TOKEN))
    finally:
        if path == "/pause_generation":  # the other tests generate
            call(engine, "POST", "/continue_generation", body={}, headers=bearer(TOKEN))
    assert r.status_code == status, r.text
    assert answer in r.text  # a 400 for the body or the group, past the token, names what was wrong


def test_the_token_is_not_on_the_engines_command_line(engine):
    cmdline = Path(f"/proc/{engine.process.pid}/cmdline").read_bytes()
    assert b"--model-path" in cmdline
    assert TOKEN.encode() not in cmdline


async def test_the_client_sends_the_token_it_is_given(engine):
    client = EngineClient(engine.url, token=TOKEN, timeout_s=60)
    try:
        out = await client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0})
        assert len(out["output_ids"]) == 2
        assert await client.update_weight_version("v-client") == "weight_version is v-client"
        assert (await client.model_info())["weight_version"] == "v-client"
    finally:
        await client.aclose()


async def test_the_client_takes_the_token_from_the_environment(engine, monkeypatch):
    monkeypatch.setenv("RLMESH_AUTH_TOKEN", TOKEN)
    client = EngineClient(engine.url, timeout_s=60)
    try:
        assert "weight_version" in await client.server_info()
    finally:
        await client.aclose()


async def test_a_client_without_the_token_gets_an_error_naming_the_refusal(engine, monkeypatch):
    monkeypatch.delenv("RLMESH_AUTH_TOKEN", raising=False)
    client = EngineClient(engine.url, timeout_s=60, name="tokenless")
    try:
        assert await client.reachable(10)  # /health is open
        with pytest.raises(
            EngineError, match=r"tokenless: /generate answered 401 \(no token was sent\)"
        ) as e:
            await client.generate([1, 2], {"max_new_tokens": 1})
        assert e.value.rejected and "missing 'Authorization: Bearer <token>' header" in str(e.value)
        assert "rlmesh.auth_token" in str(e.value)
        with pytest.raises(EngineError, match="/update_weights_from_disk answered 401"):
            await client.update_weights_from_disk("/nowhere", "v9")
    finally:
        await client.aclose()


async def test_a_client_with_a_wrong_token_is_told_its_token_was_refused(engine):
    client = EngineClient(engine.url, timeout_s=60, token="not-the-token")
    try:
        with pytest.raises(EngineError, match=r"answered 401 \(the token sent was refused\)"):
            await client.server_info()
    finally:
        await client.aclose()
