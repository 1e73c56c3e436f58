import pytest

from rlmesh.learner.ppo.partition import (
    fixed_micro_batches,
    mini_batches,
    plan_micro_batches,
    shard_rows,
    token_balanced_micro_batches,
)


def test_mini_batches_and_shards():
    assert mini_batches(range(7), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert shard_rows([10, 11, 12, 13, 14], 2) == [[10, 11, 12], [13, 14]]
    assert shard_rows([1], 2) == [[1], []]
    assert fixed_micro_batches([4, 5, 6], 2) == [[4, 5], [6]]
    assert fixed_micro_batches([4, 5, 6], None) == [[4, 5, 6]]


def test_token_balanced_respects_budget_and_keeps_every_row_once():
    lens = [9, 3, 7, 2, 5, 5, 1, 8]
    rows = list(range(100, 108))
    parts = token_balanced_micro_batches(rows, lens, max_token_len=12)
    assert sorted(r for p in parts for r in p) == rows
    for p in parts:
        assert sum(lens[r - 100] for r in p) <= 12
        assert p == sorted(p)
    assert len(parts) == 4  # ceil(40 / 12) = 4 fits here
    assert token_balanced_micro_batches(rows, lens, 12) == parts  # deterministic


def test_token_balanced_min_count_and_too_long():
    assert len(token_balanced_micro_batches([0, 1, 2], [1, 1, 1], 100, min_count=3)) == 3
    with pytest.raises(ValueError, match="does not fit"):
        token_balanced_micro_batches([0], [20], 10)


def test_plan_gives_every_rank_the_same_count():
    rows = list(range(5))
    plans = [plan_micro_batches(rows, 2, r, micro_batch_size=2) for r in range(2)]
    assert plans[0] == [[0, 1], [2]] and plans[1] == [[3, 4], []]  # rank 1 pads with a dummy
    lens = [10, 1, 1, 1, 10, 10]
    dyn = [plan_micro_batches(range(6), 2, r, micro_batch_size=None, use_dynamic_bsz=True, max_token_len=11,
                              seq_lens=lens) for r in range(2)]  # fmt: skip
    assert len(dyn[0]) == len(dyn[1])
    assert sorted(x for plan in dyn for p in plan for x in p) == list(range(6))


def test_balanced_shares_keep_the_sizes_and_even_out_the_tokens():
    # A long-tail batch in collection order: the contiguous split puts every long row on rank 0.
    lens = {r: n for r, n in enumerate([900, 800, 700, 600, 10, 10, 10, 10, 10, 10, 10, 10])}
    rows = list(lens)
    for dp in (2, 3, 4):
        contiguous = shard_rows(rows, dp)
        balanced = shard_rows(rows, dp, lens)
        assert [len(s) for s in balanced] == [len(s) for s in contiguous]
        assert sorted(r for s in balanced for r in s) == rows  # every row once
        assert all(s == sorted(s) for s in balanced)  # each share in the rows' order
        spread = [sum(lens[r] for r in s) for s in balanced]
        assert max(spread) - min(spread) < max(sum(lens[r] for r in s) for s in contiguous) - min(
            sum(lens[r] for r in s) for s in contiguous
        )
    # Four ranks: each gets one of the four long rows.
    assert sorted(sum(r < 4 for r in s) for s in shard_rows(rows, 4, lens)) == [1, 1, 1, 1]


def test_every_rank_plans_from_the_same_balanced_shares():
    lens = [50, 5, 40, 5, 30, 5, 20, 5]
    plans = [
        plan_micro_batches(range(8), 2, rank, micro_batch_size=2, seq_lens=lens, balance=True)
        for rank in (0, 1)
    ]
    assert sorted(r for plan in plans for mb in plan for r in mb) == list(range(8))
    tokens = [sum(lens[r] for mb in plan for r in mb) for plan in plans]
    assert abs(tokens[0] - tokens[1]) <= 10  # contiguous: 100 vs 60
    with pytest.raises(ValueError, match="balance needs seq_lens"):
        plan_micro_batches(range(8), 2, 0, micro_batch_size=2, balance=True)
