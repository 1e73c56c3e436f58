"""A failure that one request causes aborts that request only: the others in the same batch
finish as if it had never been sent, and the engine goes on serving. The faults are injected
into the real runner and tokenizer callback (nothing here is mocked but the fault itself)."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.engine.batching import BatchEngine, GenerationRequest
from rlmesh.engine.sampling import parse_sampling_params
from rlmesh.models import build_tiny_model, build_tokenizer

torch.set_num_threads(1)

POISON = 77  # a token id the injected faults react to
GOOD = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", build_tokenizer(), hidden_size=64, seed=2)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def run(
    engine: BatchEngine, requests: dict[str, tuple[list[list[int]], dict]]
) -> dict[str, GenerationRequest]:
    """Submits every request while the engine is held, so they share one batch; waits for all."""
    done = threading.Semaphore(0)
    made = {
        rid: GenerationRequest(rid, prompts, parse_sampling_params(params), on_done=lambda _: done.release())
        for rid, (prompts, params) in requests.items()
    }
    engine.hold(True)
    for request in made.values():
        engine.submit(request)
    engine.hold(False)
    for _ in made:
        assert done.acquire(timeout=120), "a request never completed"
    return made


def alone(model, prompts) -> list[list[int]]:
    engine = BatchEngine(model, eos_token_ids=set(), max_batch_size=16)
    engine.start()
    try:
        return [s.output_ids for s in run(engine, {"x": (prompts, GREEDY)})["x"].sequences]
    finally:
        engine.stop()


GREEDY = {"temperature": 0, "max_new_tokens": 6, "n": 2}


def test_a_prompt_whose_prefill_fails_aborts_only_its_request(model):
    engine = BatchEngine(model, eos_token_ids=set(), max_batch_size=16)
    prefill = engine.runner.prefill

    def poisoned_prefill(prompts, copies):
        if any(POISON in p for p in prompts):
            raise RuntimeError("injected prefill fault")
        return prefill(prompts, copies)

    engine.runner.prefill = poisoned_prefill
    engine.start()
    try:
        out = run(engine, {"good": (GOOD, GREEDY), "bad": ([[3, POISON, 4], [5, 6]], GREEDY)})
        assert [s.finish_reason["type"] for s in out["bad"].sequences] == ["abort"] * 4
        assert "injected prefill fault" in out["bad"].sequences[0].finish_reason["message"]
        assert [s.finish_reason["type"] for s in out["good"].sequences] == ["length"] * 4
        # Greedy outputs equal a run without the bad request: its failure left the batch intact.
        assert [s.output_ids for s in out["good"].sequences] == alone(model, GOOD)
        again = run(engine, {"later": (GOOD, GREEDY)})["later"]
        assert [s.finish_reason["type"] for s in again.sequences] == ["length"] * 4
    finally:
        engine.stop()


def test_a_stop_check_that_fails_aborts_only_its_request(model):
    calls = {"n": 0}

    def decode_text(ids: list[int]) -> str:
        calls["n"] += 1
        if calls["n"] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected decode fault")
        return " ".join(map(str, ids))

    engine = BatchEngine(model, eos_token_ids=set(), max_batch_size=16, decode_text=decode_text)
    engine.start()
    try:
        out = run(
            engine,
            {"good": (GOOD, GREEDY), "stops": ([[3, 4]], {**GREEDY, "stop": ["never printed"]})},
        )
        assert {s.finish_reason["type"] for s in out["stops"].sequences} == {"abort"}
        assert "injected decode fault" in out["stops"].sequences[0].finish_reason["message"]
        assert [s.output_ids for s in out["good"].sequences] == alone(model, GOOD)
    finally:
        engine.stop()


def test_a_failed_decode_step_aborts_the_batch_and_the_engine_serves_on(model):
    engine = BatchEngine(model, eos_token_ids=set(), max_batch_size=16)
    decode = engine.runner.decode
    fail = {"once": True}

    def failing_decode(tokens):
        if fail.pop("once", False):
            raise RuntimeError("injected decode-step fault")
        return decode(tokens)

    engine.runner.decode = failing_decode
    engine.start()
    try:
        out = run(engine, {"a": (GOOD, GREEDY)})
        assert {s.finish_reason["type"] for s in out["a"].sequences} == {"abort"}
        again = run(engine, {"b": (GOOD, GREEDY)})["b"]
        assert [s.output_ids for s in again.sequences] == alone(model, GOOD)
    finally:
        engine.stop()
