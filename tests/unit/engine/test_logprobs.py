"""The embedded engine returns, with each sampled token, its log-prob under the distribution the
learner scores it under: ``log_softmax(logits / T)`` at the rollout temperature T (the whole
vocabulary, as SGLang returns it by default and as verl's actor computes it)."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.engine.batching import BatchEngine, GenerationRequest
from rlmesh.engine.sampling import parse_sampling_params, token_logprobs
from rlmesh.models import build_tiny_model, build_tokenizer

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
ATOL = 2e-5  # fp32: the engine's KV-cached logits vs one full forward


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tokenizer = build_tokenizer()
    out = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", tokenizer, hidden_size=64, seed=1)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), tokenizer


def generate(model, tokenizer, sampling_params: dict) -> GenerationRequest:
    engine = BatchEngine(model, eos_token_ids={tokenizer.eos_token_id}, max_batch_size=8)
    done = threading.Event()
    request = GenerationRequest(
        rid="r", prompts=PROMPTS, params=parse_sampling_params(sampling_params), on_done=lambda _: done.set()
    )
    engine.start()
    try:
        engine.submit(request)
        assert done.wait(120), "the engine did not finish"
    finally:
        engine.stop()
    assert all(s.finish_reason is not None and s.finish_reason["type"] == "length" for s in request.sequences)
    return request


def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """A plain HF forward of prompt + output: the log-prob of each output token under
    ``softmax(logits / temperature)`` (what the learner computes)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize(
    "extra",
    [{}, {"top_p": 0.9, "top_k": 20}],  # truncation is not renormalised into the log-probs
    ids=["plain", "top_p_top_k"],
)
def test_logprobs_at_temperature_0_7_are_log_softmax_of_logits_over_0_7(model, extra):
    model, tokenizer = model
    sp = {"max_new_tokens": 10, "temperature": 0.7, "sampling_seed": 3, "ignore_eos": True, "n": 2, **extra}
    request = generate(model, tokenizer, sp)
    assert len(request.sequences) == len(PROMPTS) * 2
    for seq in request.sequences:
        got = torch.tensor(seq.logprobs)
        expected = hf_logprobs(model, seq.prompt_ids, seq.output_ids, 0.7)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        # The temperature-1 log-probs (what the engine returned before) are far from these.
        raw = hf_logprobs(model, seq.prompt_ids, seq.output_ids, 1.0)
        assert (got - raw).abs().max() > 100 * ATOL


def test_greedy_logprobs_are_at_temperature_1(model):
    model, tokenizer = model
    request = generate(model, tokenizer, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    for seq in request.sequences:
        expected = hf_logprobs(model, seq.prompt_ids, seq.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=ATOL, rtol=0)


def test_token_logprobs_uses_each_rows_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=g) * 3
    tokens = torch.tensor([3, 0, 29, 7])
    params = [
        parse_sampling_params({"temperature": 0.7}),
        parse_sampling_params({"temperature": 0}),  # greedy: T = 1
        parse_sampling_params({"temperature": 1.3, "top_p": 0.5, "min_p": 0.1}),
        parse_sampling_params({"temperature": 0.5, "top_k": 1}),  # top_k = 1 keeps its temperature
    ]
    got = token_logprobs(logits, tokens, params)
    for r, temperature in enumerate([0.7, 1.0, 1.3, 0.5]):
        expected = torch.log_softmax(logits[r] / temperature, -1)[tokens[r]]
        torch.testing.assert_close(got[r], expected)
    assert got.dtype == torch.float32


def test_token_logprobs_keep_the_min_new_tokens_stop_mask():
    # Stop tokens masked to -inf (min_new_tokens) are out of the support, as in SGLang, where the
    # penalty is applied to the logits before the sampler takes its log-probs.
    logits = torch.tensor([[1.0, 2.0, float("-inf"), 0.5]])
    got = token_logprobs(logits, torch.tensor([1]), [parse_sampling_params({"temperature": 0.7})])
    expected = torch.log_softmax(torch.tensor([1.0, 2.0, 0.5]) / 0.7, -1)[1]
    torch.testing.assert_close(got[0], expected)
