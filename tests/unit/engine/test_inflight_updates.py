"""Weights that change between two decode steps (an in-place update: paused, written, version set,
continued) reach the sequences already running, with their KV cache kept, and every token says
which version sampled it. The update is made inside the real engine thread, between its steps,
where the engine's own lock lets an update in."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.engine.batching import BatchEngine, GenerationRequest
from rlmesh.engine.sampling import parse_sampling_params
from rlmesh.models import build_tiny_model, build_tokenizer

torch.set_num_threads(1)

TOKENS = 8
UPDATE_AT = 3  # the update lands before the 3rd decode step: tokens 1..3 are the old weights'


@pytest.fixture
def model(tmp_path):
    out = build_tiny_model(tmp_path / "m", build_tokenizer(), hidden_size=64, seed=4)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def generate(engine: BatchEngine) -> GenerationRequest:
    done = threading.Event()
    params = parse_sampling_params({"temperature": 0, "max_new_tokens": TOKENS, "ignore_eos": True})
    request = GenerationRequest("r", [[5, 6, 7, 8]], params, on_done=lambda _: done.set())
    engine.start()
    try:
        engine.submit(request)
        assert done.wait(timeout=120), "the request never completed"
    finally:
        engine.stop()
    return request


def test_a_running_sequence_takes_new_weights_between_steps_and_tags_each_token(model):
    reference = generate(BatchEngine(model, eos_token_ids=set(), weight_version="1")).sequences[0]
    assert reference.versions == ["1"] * TOKENS

    engine = BatchEngine(model, eos_token_ids=set(), weight_version="1")
    decode, calls = engine.runner.decode, []

    def decode_with_an_update_before(last: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == UPDATE_AT:
            with engine.exclusive() as held, torch.no_grad():  # what a push does between steps
                held.model.norm.weight.mul_(4.0)  # sharper logits: other log-probs from here on
                engine.weight_version = "2"
        return decode(last)

    engine.runner.decode = decode_with_an_update_before
    seq = generate(engine).sequences[0]

    assert seq.versions == ["1"] * UPDATE_AT + ["2"] * (TOKENS - UPDATE_AT)
    assert seq.finish_reason["type"] == "length" and len(seq.output_ids) == TOKENS
    # Before the update: the tokens and log-probs of a run without one; after: other weights.
    assert seq.output_ids[:UPDATE_AT] == reference.output_ids[:UPDATE_AT]
    assert seq.logprobs[:UPDATE_AT] == pytest.approx(reference.logprobs[:UPDATE_AT], abs=1e-6)
    after, before = seq.logprobs[UPDATE_AT:], reference.logprobs[UPDATE_AT:]
    assert all(abs(a - b) > 1e-3 for a, b in zip(after, before, strict=True)), (after, before)
