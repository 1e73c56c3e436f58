"""rlmesh.algo.packing: units placed whole into rows, and the block-diagonal causal mask."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.algo.packing import first_fit_decreasing, pack_units, packing_plan


@given(lengths=st.lists(st.integers(1, 50), max_size=40), capacity=st.integers(1, 120))
@settings(max_examples=200, deadline=None)
def test_bins_hold_every_item_once_within_the_capacity(lengths, capacity):
    bins = first_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= capacity


def test_plan_rows_are_no_longer_than_the_longest_unit():
    lengths = [30, 4, 6, 5, 7, 3, 28, 2]
    rows, width = packing_plan(lengths)
    assert width == 30 and len(rows) == 3  # 30 | 28 + 2 | 7 + 6 + 5 + 4 + 3
    assert all(sum(lengths[u] for u in row) <= 30 for row in rows)
    assert packing_plan([]) == ([], 0)


def _pieces(lengths, seed=0):
    rng = random.Random(seed)
    ids = [torch.tensor([rng.randrange(1, 100) for _ in range(n)]) for n in lengths]
    positions = [torch.arange(n) + 100 * i for i, n in enumerate(lengths)]  # recognisable positions
    return ids, positions


def test_every_piece_lands_whole_and_attends_only_inside_its_unit():
    # Unit 0: a prefix and two continuations (shared prompt); units 1 and 2: prompt + response;
    # piece 7 belongs to no unit.
    lengths = [3, 2, 4, 5, 1, 2, 2, 6]
    units = [[0, 1, 2], [3, 4], [5, 6]]
    ids, positions = _pieces(lengths)
    packed = pack_units(torch.cat(ids), torch.cat(positions), lengths, units, pad_id=-1)
    assert packed.row[7] == -1 and packed.start[7] == -1
    unit_of = {i: u for u, unit in enumerate(units) for i in unit}
    part_of = {i: k for unit in units for k, i in enumerate(unit)}
    cells = {}  # (row, column) -> piece
    for i in range(7):
        r, s = int(packed.row[i]), int(packed.start[i])
        assert torch.equal(packed.input_ids[r, s : s + lengths[i]], ids[i])
        assert torch.equal(packed.position_ids[r, s : s + lengths[i]], positions[i])
        cells.update({(r, c): i for c in range(s, s + lengths[i])})
    rows, width = packed.input_ids.shape
    assert width == 9  # the longest unit: 3 + 2 + 4
    for r in range(rows):
        for q in range(width):
            seen = packed.attention_mask[r, 0, q].nonzero().flatten().tolist()
            if (r, q) not in cells:  # padding sees itself only
                assert seen == [q] and packed.input_ids[r, q] == -1
                continue
            i = cells[(r, q)]
            want = [
                k
                for k in range(q + 1)
                if (r, k) in cells
                and unit_of[cells[(r, k)]] == unit_of[i]
                and part_of[cells[(r, k)]] in (0, part_of[i])
            ]
            assert seen == want, (r, q)
    # A unit lies in one row, its prefix first, its pieces back to back.
    for unit in units:
        assert len({int(packed.row[i]) for i in unit}) == 1
        starts = [int(packed.start[i]) for i in unit]
        assert starts == [starts[0] + sum(lengths[j] for j in unit[:k]) for k in range(len(unit))]
