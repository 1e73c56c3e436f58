"""Batched sampling: each row follows its own parameters and its own seed."""

import torch

from rlmesh.engine.sampling import parse_sampling_params, sample_tokens, sampling_probs


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def test_a_rows_token_depends_on_its_seed_not_on_its_neighbours():
    sp = parse_sampling_params({"temperature": 1.0})
    logits = torch.randn(6, 50, generator=gen(0))
    batch = sample_tokens(logits, [sp] * 6, [gen(100 + r) for r in range(6)])
    alone = [int(sample_tokens(logits[r : r + 1], [sp], [gen(100 + r)])[0]) for r in range(6)]
    assert batch.tolist() == alone


def test_frequencies_follow_the_softmax():
    sp = parse_sampling_params({"temperature": 0.7})
    g = gen(1)
    draws = torch.cat([sample_tokens(LOGITS.expand(500, -1), [sp] * 500, [g] * 500) for _ in range(8)])
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    torch.testing.assert_close(freq, torch.softmax(LOGITS / 0.7, -1), atol=0.025, rtol=0)


def test_truncations_keep_only_the_allowed_tokens():
    g = gen(2)
    cases = {
        "top_k": ({"top_k": 2}, {0, 1}),
        "top_p": ({"top_p": 0.5}, {0}),  # the top token alone holds >= 0.5 of the mass
        "min_p": ({"min_p": 0.3}, {0, 1}),  # p(2)/p(0) = e^-1.5 < 0.3 <= p(1)/p(0) = e^-1
    }
    for name, (params, allowed) in cases.items():
        sp = parse_sampling_params(params)
        draws = set(sample_tokens(LOGITS.expand(400, -1), [sp] * 400, [g] * 400).tolist())
        assert draws == allowed, name
        probs = sampling_probs(LOGITS[None], sp)[0]
        assert set(torch.nonzero(probs).flatten().tolist()) == allowed, name


def test_greedy_and_sampled_rows_mix_in_one_batch():
    greedy = parse_sampling_params({"temperature": 0})
    hot = parse_sampling_params({"temperature": 5.0})
    logits = LOGITS.expand(200, -1)
    params = [greedy if r % 2 == 0 else hot for r in range(200)]
    tokens = sample_tokens(logits, params, [gen(r) for r in range(200)])
    assert set(tokens[0::2].tolist()) == {0}
    assert len(set(tokens[1::2].tolist())) > 1
