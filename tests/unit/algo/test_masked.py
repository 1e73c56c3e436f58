import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh.algo import clip_by_value, masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
# Valid entries: 1, 2, 4. Sum 7, mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 14/3,
# biased variance 14/9, unbiased 7/3.


def test_masked_sum_and_mean_by_hand():
    assert masked_sum(VALUES, MASK).item() == 7.0
    assert masked_sum(VALUES, MASK, axis=-1).tolist() == [3.0, 4.0]
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7 / 3)
    assert masked_mean(VALUES, MASK, axis=-1).tolist() == pytest.approx([1.5, 4.0])
    assert masked_mean(VALUES, MASK, axis=0).tolist() == pytest.approx([2.5, 2.0, 0.0])


def test_masked_mean_of_nothing_is_zero():
    assert masked_mean(VALUES, torch.zeros_like(MASK)).item() == 0.0


def test_masked_var_by_hand():
    assert masked_var(VALUES, MASK).item() == pytest.approx(7 / 3)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(14 / 9)


def test_masked_var_rejects_fewer_than_two_elements():
    with pytest.raises(ValueError, match="no element"):
        masked_var(VALUES, torch.zeros_like(MASK))
    one = torch.zeros_like(MASK)
    one[0, 0] = 1
    with pytest.raises(ValueError, match="one element"):
        masked_var(VALUES, one)


def test_masked_whiten_by_hand():
    scale = 1 / math.sqrt(7 / 3 + 1e-8)
    out = masked_whiten(VALUES, MASK)
    assert out[0, 0].item() == pytest.approx((1 - 7 / 3) * scale)
    assert out[0, 1].item() == pytest.approx((2 - 7 / 3) * scale)
    assert out[1, 0].item() == pytest.approx((4 - 7 / 3) * scale)
    unshifted = masked_whiten(VALUES, MASK, shift_mean=False)
    assert unshifted[1, 0].item() == pytest.approx((4 - 7 / 3) * scale + 7 / 3)


def test_nan_at_masked_positions_is_ignored():
    dirty = VALUES.clone()
    dirty[0, 2] = float("nan")
    dirty[1, 1] = float("inf")
    assert masked_sum(dirty, MASK).item() == 7.0
    assert masked_mean(dirty, MASK).item() == pytest.approx(7 / 3)
    assert masked_var(dirty, MASK).item() == pytest.approx(7 / 3)
    valid = MASK.bool()
    assert torch.equal(masked_whiten(dirty, MASK)[valid], masked_whiten(VALUES, MASK)[valid])


def test_clip_by_value_by_hand():
    x = torch.tensor([0.0, 1.0, 5.0])
    out = clip_by_value(x, torch.tensor([0.5, 0.5, 0.5]), torch.tensor([2.0, 2.0, 4.0]))
    assert out.tolist() == [0.5, 1.0, 4.0]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bs=st.integers(1, 5),
    length=st.integers(2, 9),
    junk=st.sampled_from([float("nan"), float("inf"), -1e30, 7.0]),
)
def test_masked_positions_never_change_a_result(seed, bs, length, junk):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(bs, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(bs, length, generator=gen) > 0.4).long()
    mask[0, 0] = 1
    mask[-1, -1] = 1  # at least two valid entries for the unbiased variance
    dirty = torch.where(mask.bool(), values, torch.full_like(values, junk))
    valid = mask.bool()
    assert torch.equal(masked_sum(dirty, mask), masked_sum(values, mask))
    assert torch.equal(masked_mean(dirty, mask, axis=-1), masked_mean(values, mask, axis=-1))
    assert torch.equal(masked_var(dirty, mask), masked_var(values, mask))
    assert torch.equal(masked_whiten(dirty, mask)[valid], masked_whiten(values, mask)[valid])
