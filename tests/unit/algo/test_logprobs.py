import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.algo import entropy_from_logits, logprobs_from_logits, logprobs_from_logits_naive


def _reference(logits, labels):
    return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def test_logprobs_by_hand():
    # softmax of [0, log 2, log 3] is [1/6, 1/3, 1/2]; uniform over 4 gives 1/4 each.
    logits = torch.tensor([[0.0, math.log(2), math.log(3), -1e9], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([1, 2])
    out = logprobs_from_logits(logits, labels)
    assert out.tolist() == pytest.approx([math.log(1 / 3), math.log(1 / 4)])


def test_entropy_by_hand():
    logits = torch.tensor([[0.0, math.log(2), math.log(3)], [1.0, 1.0, 1.0]], dtype=torch.float64)
    expected_first = -(1 / 6 * math.log(1 / 6) + 1 / 3 * math.log(1 / 3) + 1 / 2 * math.log(1 / 2))
    assert entropy_from_logits(logits).tolist() == pytest.approx([expected_first, math.log(3)])


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 1000])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_logprobs_equal_log_softmax_gather(chunk_size, shape):
    gen = torch.Generator().manual_seed(0)
    vocab = 257
    logits = torch.randn(*shape, vocab, generator=gen) * 3
    labels = torch.randint(0, vocab, shape, generator=gen)
    out = logprobs_from_logits(logits, labels, chunk_size=chunk_size)
    assert out.shape == shape
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _reference(logits, labels), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logprobs_from_logits_naive(logits, labels), _reference(logits, labels))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 40),
    vocab=st.integers(2, 300),
    chunk=st.integers(1, 50),
)
def test_logprobs_match_reference_property(seed, rows, vocab, chunk):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 5
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    torch.testing.assert_close(
        logprobs_from_logits(logits, labels, chunk_size=chunk),
        _reference(logits, labels),
        rtol=1e-6,
        atol=1e-6,
    )


def test_logprobs_gradient_matches_reference():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(4, 6, 33, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 33, (4, 6), generator=gen)
    weights = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    ours = base.clone().requires_grad_()
    (logprobs_from_logits(ours, labels, chunk_size=5) * weights).sum().backward()
    ref = base.clone().requires_grad_()
    (_reference(ref, labels) * weights).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad)


def test_logprobs_gradcheck():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (3, 4), generator=gen)
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, labels, chunk_size=2), (logits,))


def test_logprobs_bfloat16_close_to_fp32():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 64, generator=gen)
    labels = torch.randint(0, 64, (2, 5), generator=gen)
    out = logprobs_from_logits(logits.bfloat16(), labels)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), _reference(logits.bfloat16().float(), labels), rtol=1e-2, atol=2e-2
    )


def test_logprobs_rejects_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_from_logits(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_size=0)
