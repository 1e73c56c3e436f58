"""Reference log-probs in the library: token-budgeted micro-batches, equal to direct forwards."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from rlmesh.reference import (
    InvalidRequestError,
    ReferenceModel,
    compute_ref_log_probs,
    token_budget_micro_batches,
)
from rlmesh.v1 import reference_pb2


@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=60),
    budget=st.integers(1, 2000),
    max_samples=st.one_of(st.none(), st.integers(1, 10)),
)
@settings(max_examples=200, deadline=None)
def test_micro_batches_cover_every_sample_once_within_the_budget(lengths, budget, max_samples):
    batches = token_budget_micro_batches(lengths, budget, max_samples)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
        assert max_samples is None or len(b) <= max_samples


def test_micro_batches_pack_similar_lengths():
    assert token_budget_micro_batches([5, 3, 10, 2, 2, 9, 1], 20) == [[2, 5], [0, 1, 3, 4], [6]]
    assert token_budget_micro_batches([30, 1], 20) == [[0], [1]]  # an over-budget sample goes alone
    with pytest.raises(ValueError, match="max_tokens"):
        token_budget_micro_batches([1], 0)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def direct(model, prompt, response, temperature=1.0):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt) :]].tolist()


def random_batch(n, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    responses = [[rng.randrange(100) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    return prompts, responses


@pytest.mark.parametrize("budget", [80, 256, 100_000])
def test_log_probs_equal_a_direct_forward_per_sample(model, budget):
    prompts, responses = random_batch(12)
    forwards = []
    got = compute_ref_log_probs(
        model, prompts, responses, max_tokens_per_batch=budget, on_micro_batch=lambda r, t: forwards.append(t)
    )
    assert all(t <= budget for t in forwards) and (len(forwards) > 1) == (budget < 1000)
    for p, r, lp in zip(prompts, responses, got, strict=True):
        assert len(lp) == len(r)
        assert lp == pytest.approx(direct(model, p, r), abs=1e-5)


def test_temperature_divides_the_logits(model):
    prompts, responses = random_batch(3, seed=1)
    got = compute_ref_log_probs(model, prompts, responses, temperature=0.7)
    for p, r, lp in zip(prompts, responses, got, strict=True):
        assert lp == pytest.approx(direct(model, p, r, temperature=0.7), abs=1e-5)


def test_reference_model_validates_and_computes(tiny_model_dir):
    ref = ReferenceModel.load(str(tiny_model_dir), device="cpu", max_tokens_per_batch=64, max_batch_size=4)
    assert ref.vocab_size == 100 and ref.dtype_name == "float32" and ref.max_positions == 256

    def s(uid, p, r):
        return reference_pb2.LogProbsSample(uid=uid, prompt_ids=p, response_ids=r)

    assert ref.busy.busy_s == 0.0
    (lp,) = ref.log_probs([s("a", [1, 2, 3], [4, 5])])
    assert len(lp) == 2 and all(x < 0 for x in lp)
    ((start, end),) = ref.busy.intervals()  # the forward counted as busy, once
    assert ref.busy.busy_s == pytest.approx(end - start) and ref.busy.in_flight == 0
    cases = {
        "empty batch": [],
        "batch of 5 samples is over this service's max_batch_size of 4": [
            s(str(i), [1], [2]) for i in range(5)
        ],
        "sample 0 (uid 'p'): prompt_ids is empty": [s("p", [], [1])],
        "sample 1 (uid 'r'): response_ids is empty": [s("a", [1], [1]), s("r", [1], [])],
        "sample 0 (uid 'v'): response_ids holds token id 100, not below the vocabulary size 100": [
            s("v", [1], [2, 100])
        ],
        "prompt_ids holds a negative token id -3": [s("n", [-3], [1])],
        "40 prompt + 30 response tokens = 70, over the token budget per forward of 64": [
            s("long", [1] * 40, [2] * 30)
        ],
    }
    for message, batch in cases.items():
        with pytest.raises(InvalidRequestError) as err:
            ref.log_probs(batch)
        assert message in str(err.value), (message, str(err.value))
