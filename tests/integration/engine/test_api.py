"""The embedded engine's SGLang API, against a real engine process."""

import asyncio

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.engine.client import EngineClient
from rlmesh.job.report import metric_sum

PROMPTS = [[10, 20, 30, 40], [5, 6, 7], [80, 81, 82, 83, 84, 85, 86], [42]]


def post(engine, path, body):
    return httpx.post(engine.url + path, json=body, timeout=120)


def test_generate_single_answers_sglang_shape(engine):
    r = post(
        engine,
        "/generate",
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, dict) and len(out["output_ids"]) == 5
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert (
        meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 5 and meta["weight_version"] == "default"
    )
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
    # rlmesh's own field beside SGLang's: the version that sampled each token.
    assert meta["output_token_weight_versions"] == ["default"] * 5
    assert isinstance(out["text"], str)


def test_generate_batch_with_n_answers_a_prompt_major_list(engine):
    r = post(
        engine,
        "/generate",
        {"input_ids": PROMPTS[:2], "sampling_params": {"max_new_tokens": 3, "n": 3, "sampling_seed": 7}},
    )
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [4, 4, 4, 3, 3, 3]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "seed": 3}},
            "unknown sampling_params keys ['seed']",
        ),
        ({"input_ids": [1, 100000]}, "input_ids[1]=100000: token ids must be integers in [0, 100)"),
        ({"input_ids": [[1], [2, -1]]}, "input_ids[1][1]=-1"),
        ({"input_ids": []}, "input_ids: expected a non-empty list"),
        ({"input_ids": [1, "a"]}, "input_ids[1]='a'"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p=0.0: must be in (0, 1]"),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": "ten"}},
            "sampling_params.max_new_tokens: expected a number",
        ),
        ({"input_ids": [1], "stream": True}, "stream=true is not supported"),
        ({"text": "hello"}, "takes input_ids only"),
        # The tiny model's context is 1024 tokens (max_position_embeddings).
        (
            {"input_ids": [[1], [1] * 1000], "sampling_params": {"max_new_tokens": 30}},
            "input_ids[1]: 1000 tokens + sampling_params.max_new_tokens=30 exceed the model's context of 1024",
        ),
        (
            {"input_ids": [[1], [2]], "sampling_params": {"n": 2049}},
            "2 prompt(s) x sampling_params.n=2049 = 4098 sequences; at most 4096 per request",
        ),
    ],
)
def test_bad_requests_get_400_naming_what_is_wrong(engine, body, message):
    r = post(engine, "/generate", body)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def test_malformed_json_gets_400_and_the_engine_keeps_serving(engine):
    r = httpx.post(
        engine.url + "/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.text
    assert (
        post(engine, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).status_code
        == 200
    )


def test_logprobs_equal_a_direct_forward_pass(engine, tiny_model_dir):
    r = post(
        engine,
        "/generate",
        {
            "input_ids": PROMPTS,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 1.0,
                "sampling_seed": 3,
                "ignore_eos": True,
            },
        },
    )
    outs = r.json()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        full = torch.tensor([prompt + out["output_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(full).logits[0].float(), -1)
        expected = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-5


def test_greedy_is_deterministic_and_independent_of_batching(engine):
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    alone = [
        post(engine, "/generate", {"input_ids": p, "sampling_params": sp}).json()["output_ids"]
        for p in PROMPTS
    ]
    batched = [
        o["output_ids"]
        for o in post(engine, "/generate", {"input_ids": PROMPTS, "sampling_params": sp}).json()
    ]
    again = [
        o["output_ids"]
        for o in post(engine, "/generate", {"input_ids": PROMPTS, "sampling_params": sp}).json()
    ]
    assert alone == batched == again


def test_seeded_sampling_is_reproducible(engine):
    def sample(seed):
        sp = {
            "max_new_tokens": 12,
            "temperature": 1.0,
            "top_p": 0.95,
            "top_k": 50,
            "sampling_seed": seed,
            "ignore_eos": True,
        }
        return [
            o["output_ids"]
            for o in post(engine, "/generate", {"input_ids": PROMPTS, "sampling_params": sp}).json()
        ]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


async def test_concurrent_requests_match_sequential_ones(engine):
    client = EngineClient(engine.url)
    sps = [
        {"max_new_tokens": 4 + 3 * i, "temperature": 0.8, "sampling_seed": 100 + i, "ignore_eos": True}
        for i in range(len(PROMPTS))
    ]
    try:
        sequential = [
            (await client.generate(p, sp))["output_ids"] for p, sp in zip(PROMPTS, sps, strict=True)
        ]
        together = await asyncio.gather(*(client.generate(p, sp) for p, sp in zip(PROMPTS, sps, strict=True)))
    finally:
        await client.aclose()
    assert [o["output_ids"] for o in together] == sequential
    assert [len(s) for s in sequential] == [4, 7, 10, 13]  # different lengths: rows left the batch early


def test_stop_token_ids_and_eos_finish_with_stop(engine):
    greedy = post(
        engine,
        "/generate",
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    target = greedy["output_ids"][2]
    r = post(
        engine,
        "/generate",
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [target]},
        },
    ).json()
    first = greedy["output_ids"].index(target)
    assert r["output_ids"] == greedy["output_ids"][: first + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    m = post(
        engine,
        "/generate",
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {
                "max_new_tokens": 8,
                "temperature": 0,
                "stop_token_ids": [target],
                "min_new_tokens": 8,
            },
        },
    ).json()
    assert len(m["output_ids"]) == 8 and m["meta_info"]["finish_reason"]["type"] == "length"


def test_control_endpoints(engine):
    assert httpx.get(engine.url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(engine.url + "/get_model_info").json()
    assert info["is_generation"] is True and info["vocab_size"] == 100
    assert httpx.post(engine.url + "/flush_cache").status_code == 200
    assert post(engine, "/pause_generation", {}).json()["success"]
    assert post(engine, "/continue_generation", {}).json()["success"]
    assert post(engine, "/update_weight_version", {"new_version": "v7"}).json()["success"]
    out = post(engine, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).json()
    assert out["meta_info"]["weight_version"] == "v7"
    w = post(engine, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4}).json()
    assert len(w) == 4
    assert post(engine, "/get_weights_by_name", {"name": "nope"}).status_code == 400
    metrics = httpx.get(engine.url + "/metrics").text
    assert "rlmesh_engine_generated_tokens_total" in metrics


def test_metrics_count_generate_calls_and_their_sequences(engine):
    def calls_and_sequences():
        text = httpx.get(engine.url + "/metrics").text
        return metric_sum(text, "rlmesh_engine_generate_batch_size_count"), metric_sum(
            text, "rlmesh_engine_generate_batch_size_sum"
        )

    calls, sequences = calls_and_sequences()
    one = {"max_new_tokens": 2, "ignore_eos": True}
    assert post(engine, "/generate", {"input_ids": PROMPTS[0], "sampling_params": one}).status_code == 200
    batched = {"input_ids": PROMPTS[:3], "sampling_params": {**one, "n": 2}}
    assert post(engine, "/generate", batched).status_code == 200
    assert calls_and_sequences() == (calls + 2, sequences + 1 + 6)  # 1 call of 1, 1 of 3 prompts x 2


async def test_paused_engine_holds_requests_and_abort_ends_them(engine):
    client = EngineClient(engine.url)
    try:
        await client.pause_generation()
        pending = asyncio.create_task(
            client.generate([1, 2, 3], {"max_new_tokens": 50, "ignore_eos": True}, rid="held")
        )
        info = {}
        while info.get("waiting", 0) + info.get("running", 0) == 0:
            info = httpx.get(engine.url + "/get_server_info").json()
            await asyncio.sleep(0.01)
        assert not pending.done()
        # A second request under a running one's rid is refused, not put in its place.
        again = post(engine, "/generate", {"input_ids": [4], "rid": "held", "sampling_params": {}})
        assert again.status_code == 400 and "rid 'held' is already running" in again.text
        await client.abort_request("held")
        out = await pending
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        await client.continue_generation()
        await client.aclose()
