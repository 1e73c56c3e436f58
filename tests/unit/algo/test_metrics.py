import math

import pytest
import torch

import rlmesh.algo
from rlmesh.algo import compute_approx_kl, compute_clipfrac, compute_data_metrics, masked_stats


def test_clipfrac_by_hand():
    # ratios 0.5 (below 0.8), 1.0, 1.25 (inside), 1.35 (above 1.3); masked 10.0
    ratios = torch.tensor([[0.5, 1.0, 1.25, 1.35, 10.0]], dtype=torch.float64)
    old = torch.full_like(ratios, -1.0)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert compute_clipfrac(old + ratios.log(), old, mask, 0.2, 0.3).item() == pytest.approx(0.5)


def test_approx_kl_by_hand():
    old = torch.tensor([[-1.0, -2.0, -9.0]], dtype=torch.float64)
    new = torch.tensor([[-1.5, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    # k1: mean(old - new) = (0.5 - 1) / 2
    assert compute_approx_kl(new, old, mask).item() == pytest.approx(-0.25)
    # k3 with d = old - new: e^{-d} + d - 1 -> (e^{-0.5} - 0.5) and (e^{1} - 2)
    expected = ((math.exp(-0.5) + 0.5 - 1) + (math.exp(1) - 1 - 1)) / 2
    assert compute_approx_kl(new, old, mask, "k3").item() == pytest.approx(expected)


def test_masked_stats_by_hand():
    values = torch.tensor([[1.0, 2.0], [3.0, 99.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert masked_stats(values, mask) == {"mean": 2.0, "max": 3.0, "min": 1.0}
    assert masked_stats(values, torch.zeros_like(mask)) == {"mean": 0.0, "max": 0.0, "min": 0.0}


def test_data_metrics_by_hand():
    advantages = torch.tensor([[1.0, 2.0], [3.0, 99.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 2.0], [3.0, 50.0]], dtype=torch.float64)
    values = torch.tensor([[1.0, 2.0], [2.0, -7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    metrics = compute_data_metrics(advantages, returns, mask, values)
    assert metrics["critic/advantages/mean"] == pytest.approx(2.0)
    assert metrics["critic/returns/max"] == pytest.approx(3.0)
    assert metrics["critic/values/min"] == pytest.approx(1.0)
    # returns - values = [0, 0, 1]: unbiased var 1/3; var(returns [1, 2, 3]) = 1
    assert metrics["critic/vf_explained_var"] == pytest.approx(1 - (1 / 3) / (1 + 1e-5))
    assert "critic/values/mean" not in compute_data_metrics(advantages, returns, mask)


def test_every_public_name_is_exported():
    for name in rlmesh.algo.__all__:
        assert getattr(rlmesh.algo, name) is not None, name
