"""The JSON the engine client sends and how it reads SGLang's answers, against recorded shapes of
SGLang's native API (sglang 0.5.23: srt/entrypoints/http_server.py, srt/managers/io_struct.py; the
0.5.5.post3 wheel for the older behaviour). No server: an httpx mock transport records each call."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from rlmesh.engine.client import EngineClient, EngineError, parse_server_version

Handler = Callable[[httpx.Request], httpx.Response]


def client_with(handler: Handler) -> tuple[EngineClient, list[tuple[str, str, object]]]:
    """An EngineClient whose HTTP goes to ``handler``; the list collects (method, path, json body)."""
    calls: list[tuple[str, str, object]] = []

    def record(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        calls.append((request.method, request.url.path, body))
        return handler(request)

    client = EngineClient("http://sglang.test", timeout_s=5, name="sgl")
    client._http = httpx.AsyncClient(base_url=client.url, transport=httpx.MockTransport(record))
    return client, calls


def ok(body: object = None) -> httpx.Response:
    return httpx.Response(200, json={"success": True, "message": "Success"} if body is None else body)


def server_info(version: str | None, tp_size: int = 1) -> dict:
    info: dict = {"tp_size": tp_size, "dp_size": 1, "pp_size": 1}
    if version is not None:
        info["version"] = version
    return info


def test_parse_server_version():
    assert parse_server_version("0.5.23") == (0, 5, 23)
    assert parse_server_version("0.5.5.post3") == (0, 5, 5)
    assert parse_server_version("0.5.6.dev12+g1234") == (0, 5, 6)
    assert parse_server_version(None) is None and parse_server_version("embedded") is None


async def test_init_weights_update_group_body_has_sglangs_field_names():
    client, calls = client_with(lambda r: ok())
    await client.init_weights_update_group("10.0.0.1", 29555, 1, 3, "g1", "nccl")
    # InitWeightsUpdateGroupReqInput: master_address, master_port, rank_offset, world_size, group_name, backend
    assert calls == [
        (
            "POST",
            "/init_weights_update_group",
            {
                "master_address": "10.0.0.1",
                "master_port": 29555,
                "rank_offset": 1,
                "world_size": 3,
                "group_name": "g1",
                "backend": "nccl",
            },
        )
    ]


async def test_flattened_bucket_update_is_sent_to_a_server_that_has_it():
    def handler(r: httpx.Request) -> httpx.Response:
        if r.url.path == "/server_info":
            return ok(server_info("0.5.23"))
        return ok({"success": True, "message": "Succeeded to update parameter online."})

    client, calls = client_with(handler)
    await client.update_weights_from_distributed(
        ["a.weight", "b.bias"],
        ["bfloat16", "float32"],
        [(4, 2), [3]],
        "g1",
        "7",
        load_format="flattened_bucket",
    )
    await client.update_weights_from_distributed(
        ["c"], ["bfloat16"], [[1]], "g1", "7", load_format="flattened_bucket"
    )
    paths = [c[1] for c in calls]  # the version is asked once
    assert paths == ["/server_info", "/update_weights_from_distributed", "/update_weights_from_distributed"]
    # UpdateWeightsFromDistributedReqInput: names, dtypes, shapes, group_name, flush_cache, weight_version, load_format
    assert calls[1][2] == {
        "names": ["a.weight", "b.bias"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[4, 2], [3]],
        "group_name": "g1",
        "flush_cache": False,
        "weight_version": "7",
        "load_format": "flattened_bucket",
    }


async def test_flattened_bucket_is_refused_before_sglang_0_5_6():
    """0.5.5.post3 has no load_format field: it would be dropped and the server would wait for one
    broadcast per tensor while the trainer sends one."""

    def handler(r: httpx.Request) -> httpx.Response:
        if r.url.path == "/server_info":
            return httpx.Response(404, json={"detail": "Not Found"})
        if r.url.path == "/get_server_info":
            return ok(server_info("0.5.5.post3"))
        return ok()

    client, calls = client_with(handler)
    with pytest.raises(EngineError, match=r"needs SGLang 0\.5\.6\+ \(this server: 0\.5\.5\)") as e:
        await client.update_weights_from_distributed(
            ["a"], ["bfloat16"], [[2]], "g", "1", load_format="flattened_bucket"
        )
    assert e.value.rejected
    assert "/update_weights_from_distributed" not in [c[1] for c in calls]
    # Per tensor still goes out, without a load_format key.
    await client.update_weights_from_distributed(["a"], ["bfloat16"], [[2]], "g", "1")
    assert calls[-1][1] == "/update_weights_from_distributed" and "load_format" not in calls[-1][2]


async def test_the_embedded_engine_names_no_version_and_takes_flattened_buckets():
    def handler(r: httpx.Request) -> httpx.Response:
        if r.url.path == "/server_info":
            return httpx.Response(404)
        if r.url.path == "/get_server_info":
            return ok({"engine": "embedded", "weight_version": "default"})
        return ok()

    client, calls = client_with(handler)
    await client.update_weights_from_distributed(
        ["a"], ["float32"], [[2]], "g", None, load_format="flattened_bucket"
    )
    assert calls[-1][1] == "/update_weights_from_distributed" and "weight_version" not in calls[-1][2]


async def test_update_failure_message_and_status_are_kept():
    # 0.5.23 refuses an update outside begin/end with success=false, 400, before any receive.
    message = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
    client, _ = client_with(lambda r: httpx.Response(400, json={"success": False, "message": message}))
    with pytest.raises(EngineError, match="must run between") as e:
        await client.update_weights_from_distributed(["a"], ["float32"], [[2]], "g", "1")
    assert e.value.status == 400


async def test_model_info_prefers_model_info_and_remembers_the_old_name():
    def new(r: httpx.Request) -> httpx.Response:
        return (
            ok({"model_path": "/m", "weight_version": "3"})
            if r.url.path == "/model_info"
            else httpx.Response(404)
        )

    client, calls = client_with(new)
    assert (await client.model_info())["weight_version"] == "3"
    assert [c[1] for c in calls] == ["/model_info"]  # /get_model_info logs a deprecation warning per call

    def old(r: httpx.Request) -> httpx.Response:  # SGLang <= 0.5.5
        return ok({"weight_version": "default"}) if r.url.path == "/get_model_info" else httpx.Response(404)

    client, calls = client_with(old)
    await client.model_info()
    await client.model_info()
    assert [c[1] for c in calls] == ["/model_info", "/get_model_info", "/get_model_info"]


async def test_update_weight_version_does_not_abort_running_requests():
    # UpdateWeightVersionReqInput.abort_all_requests defaults to True in SGLang.
    client, calls = client_with(lambda r: ok({"success": True, "message": "ok", "new_version": "4"}))
    await client.update_weight_version("4")
    assert calls == [("POST", "/update_weight_version", {"new_version": "4", "abort_all_requests": False})]


async def test_pause_retracts_and_failures_are_raised():
    answers = iter([ok({"message": "Generation paused successfully.", "status": "ok"}), httpx.Response(500)])
    client, calls = client_with(lambda r: next(answers))
    await client.pause_generation()
    assert calls == [("POST", "/pause_generation", {"mode": "retract"})]
    with pytest.raises(EngineError):
        await client.continue_generation()
    assert calls[-1] == ("POST", "/continue_generation", {})


async def test_flush_refused_while_busy_raises():
    # /flush_cache answers 400 (text) while requests run or wait.
    client, calls = client_with(lambda r: httpx.Response(400, text="Flush cache failed.\n"))
    with pytest.raises(EngineError, match="400") as e:
        await client.flush_cache()
    assert e.value.rejected and calls == [("POST", "/flush_cache", None)]


async def test_begin_end_are_skipped_where_missing():
    client, calls = client_with(lambda r: httpx.Response(404, json={"detail": "Not Found"}))
    await client.begin_weight_update()
    await client.end_weight_update()
    await client.begin_weight_update()
    assert [c[1] for c in calls] == ["/begin_weight_update"]  # the 404 is remembered


async def test_begin_closes_a_session_a_dead_push_left_open():
    answers = iter(
        [
            httpx.Response(
                400,
                json={
                    "success": False,
                    "message": "a weight-update session is already open; call end_weight_update() first",
                },
            ),
            ok(),
            ok(),
        ]
    )
    client, calls = client_with(lambda r: next(answers))
    await client.begin_weight_update()
    assert [c[1] for c in calls] == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update"]
    assert all(c[2] == {} for c in calls)


async def test_begin_other_refusals_raise():
    client, _ = client_with(lambda r: httpx.Response(400, json={"success": False, "message": "no"}))
    with pytest.raises(EngineError) as e:
        await client.begin_weight_update()
    assert e.value.status == 400


# A /generate answer of SGLang 0.5.23 with --skip-tokenizer-init for input_ids=[1, 2], n=2,
# return_logprob=True, logprob_start_len=-1: a list (n > 1), no "text", logprobs [lp, id, null].
RECORDED_N2 = [
    {
        "output_ids": [5, 9],
        "meta_info": {
            "id": "3f0c",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 2,
            "weight_version": "default",
            "completion_tokens": 2,
            "cached_tokens": 2,
            "output_token_logprobs": [[-0.5, 5, None], [-1.25, 9, None]],
            "e2e_latency": 0.01,
        },
    },
    {
        "output_ids": [7],
        "meta_info": {
            "id": "3f0d",
            "finish_reason": {"type": "stop", "matched": 7},
            "prompt_tokens": 2,
            "weight_version": "default",
            "completion_tokens": 1,
            "cached_tokens": 2,
            "output_token_logprobs": [[-0.1, 7, None]],
            "e2e_latency": 0.01,
        },
    },
]


async def test_generate_body_and_a_recorded_answer():
    client, calls = client_with(lambda r: ok(RECORDED_N2))
    out = await client.generate([1, 2], {"max_new_tokens": 2, "n": 2}, rid="task-1")
    assert calls == [
        (
            "POST",
            "/generate",
            {
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 2, "n": 2},
                "return_logprob": True,
                "logprob_start_len": -1,
                "rid": "task-1",
            },
        )
    ]
    assert [o["output_ids"] for o in out] == [[5, 9], [7]]
    assert [[tid for _, tid, _ in o["meta_info"]["output_token_logprobs"]] for o in out] == [[5, 9], [7]]
    assert [o["meta_info"]["finish_reason"]["type"] for o in out] == ["length", "stop"]


async def test_generate_retries_a_duplicate_rid_under_a_fresh_one():
    answers = iter(
        [
            httpx.Response(400, json={"error": {"message": "Duplicate request ID detected: task-1"}}),
            ok(RECORDED_N2[0]),
        ]
    )
    client, calls = client_with(lambda r: next(answers))
    out = await client.generate([1, 2], {"max_new_tokens": 2}, rid="task-1")
    assert out["output_ids"] == [5, 9]
    assert calls[0][2]["rid"] == "task-1" and calls[1][2]["rid"].startswith("task-1-")


async def test_generate_other_refusals_are_not_retried():
    client, calls = client_with(
        lambda r: httpx.Response(
            400,
            json={"error": {"message": "stop=['x'] is unavailable when skip_tokenizer_init=True"}},
        )
    )
    with pytest.raises(EngineError) as e:
        await client.generate([1], {"stop": ["x"]}, rid="t")
    assert e.value.rejected and len(calls) == 1


async def test_wait_healthy_polls_instead_of_spinning():
    client, calls = client_with(lambda r: httpx.Response(503))
    with pytest.raises(EngineError, match="health_generate"):
        await client.wait_healthy(0.25, poll_s=0.1)
    assert 2 <= len(calls) <= 5 and all(c[:2] == ("GET", "/health_generate") for c in calls)
