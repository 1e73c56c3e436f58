"""Property-based fuzzing of the embedded engine's HTTP API, a real engine process: whatever a
caller posts, the engine answers 200 or a 4xx whose message names what was wrong, never a 5xx,
and generates on afterwards.

Bodies are drawn as JSON (any shape, plus bodies shaped like SGLang's with edge values: NaN,
infinities, huge integers, wrong types, unknown keys) and as raw bytes. Not fuzzed: the routes
that make the engine dial out (``/init_weights_update_group``, ``/update_weights_from_distributed``)
or hold it (``/pause_generation``); a drawn ``model_path`` never names an existing directory."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlmesh.engine.sampling import KNOWN_KEYS
from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.runtime.launcher import ProcessLauncher
from tests.support.protostrategies import FUZZ

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
token_ids = st.one_of(st.integers(-1, 120), st.sampled_from([2**31, -(2**63), 10**30]), json_values)
prompts = st.lists(token_ids, max_size=6)
# Small where an accepted value costs real work; values past every cap stay in the mix.
counts = st.one_of(st.integers(-2, 6), st.sampled_from([10**6, 2**31, -(2**63)]), json_values)
rates = st.one_of(st.floats(-1, 2), st.floats(allow_nan=True, allow_infinity=True), json_values)
SAMPLING = {
    "n": counts,
    "max_new_tokens": counts,
    "min_new_tokens": counts,
    "top_k": counts,
    "sampling_seed": counts,
    "temperature": rates,
    "top_p": rates,
    "min_p": rates,
    "repetition_penalty": rates,
    "frequency_penalty": rates,
    "presence_penalty": rates,
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3), json_values),
    "stop_token_ids": st.one_of(prompts, json_values),
    "ignore_eos": json_values,
    "skip_special_tokens": json_values,
    "no_such_key": json_values,
}
GENERATE_FIELDS = {
    "input_ids": st.one_of(prompts, st.lists(prompts, max_size=3), json_values),
    "sampling_params": st.one_of(st.fixed_dictionaries({}, optional=SAMPLING), json_values),
    "rid": json_values,
    "return_logprob": json_values,
    "stream": json_values,
    "text": json_values,
}
# Bodies that get past the first checks: a real prompt, sampling values of the right types
# (still negative, huge, NaN or past the caps), no stream.
small_counts = st.one_of(st.integers(-2, 6), st.sampled_from([10**6, 2**31]))
PLAUSIBLE_SAMPLING = {
    **{k: small_counts for k in ("n", "max_new_tokens", "min_new_tokens", "top_k", "sampling_seed")},
    **{
        k: st.floats(-0.5, 2) | st.floats(allow_nan=True, allow_infinity=True)
        for k in ("temperature", "top_p", "min_p")
    },
    "stop": st.lists(st.text(max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(-1, 120), max_size=3),
    "ignore_eos": st.booleans(),
}
real_prompt = st.lists(st.integers(0, 90), min_size=1, max_size=6)
PLAUSIBLE_GENERATE = st.fixed_dictionaries(
    {"input_ids": real_prompt | st.lists(real_prompt, min_size=1, max_size=3)},
    optional={
        "sampling_params": st.fixed_dictionaries({}, optional=PLAUSIBLE_SAMPLING),
        "return_logprob": st.booleans(),
    },
)
CONTROL_ROUTES = {
    "/get_weights_by_name": {
        "name": st.one_of(st.sampled_from(["lm_head.weight", "model.norm.weight"]), json_values),
        "truncate_size": counts,
    },
    "/update_weight_version": {"new_version": json_values},
    "/abort_request": {"rid": json_values, "abort_all": json_values},
    "/destroy_weights_update_group": {"group_name": json_values},
    "/update_weights_from_disk": {
        "model_path": st.one_of(
            st.text(max_size=10).map(lambda s: f"/nonexistent-{s}"),
            json_values.filter(lambda v: not isinstance(v, str)),
        ),
        "weight_version": json_values,
    },
}
ROUTES = ["/generate", *CONTROL_ROUTES]


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("m"), build_tokenizer(), hidden_size=64, num_layers=2)
    with ProcessLauncher(tmp_path_factory.mktemp("fuzz-engine"), stop_grace_s=20) as launcher:
        engine = launcher.start_engine(model, extra_args=["--max-batch-size", "16"])
        yield engine.url


def post(url: str, route: str, content: bytes) -> httpx.Response:
    return httpx.post(url + route, content=content, headers={"content-type": "application/json"}, timeout=120)


def check_answer(resp: httpx.Response, fields: list[str]) -> None:
    assert resp.status_code < 500, f"{resp.status_code}: {resp.text[:300]}"
    if resp.status_code >= 400:
        body = resp.json()
        message = body.get("message") or body.get("error", {}).get("message", "")
        assert any(f in message for f in [*fields, "request body", "rid"]), f"names no field: {message!r}"


def generates_on(url: str) -> None:
    assert httpx.get(url + "/health_generate", timeout=120).status_code == 200


@FUZZ
@given(body=st.fixed_dictionaries({}, optional=GENERATE_FIELDS) | PLAUSIBLE_GENERATE)
def test_generate_bodies_get_200_or_a_400_naming_the_field(engine_url, body):
    resp = post(engine_url, "/generate", json.dumps(body).encode())
    check_answer(resp, [*GENERATE_FIELDS, *KNOWN_KEYS, "sampling_params"])
    if resp.status_code == 200:
        outs = resp.json()
        for out in outs if isinstance(outs, list) else [outs]:
            assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
            assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"]


@pytest.mark.parametrize("route", list(CONTROL_ROUTES))
def test_control_bodies_get_200_or_a_4xx_naming_the_field(engine_url, route):
    fields = CONTROL_ROUTES[route]

    @FUZZ
    @given(body=st.fixed_dictionaries({}, optional=fields))
    def fuzz(body):
        check_answer(
            post(engine_url, route, json.dumps(body).encode()), [*fields, "missing fields", "failed"]
        )

    fuzz()
    generates_on(engine_url)


@pytest.mark.parametrize("route", ROUTES)
def test_arbitrary_bodies_never_get_a_5xx(engine_url, route):
    @FUZZ
    @given(content=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())))
    def fuzz(content):
        check_answer(post(engine_url, route, content), ["missing fields", "failed", *GENERATE_FIELDS])

    fuzz()
    generates_on(engine_url)
