import math

import pytest
import torch

from rlmesh.config import OptimConfig
from rlmesh.learner.ppo.schedule import build_lr_scheduler, lr_lambda, set_base_lr


def test_constant_with_warmup_is_verls():
    f = lr_lambda(OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.2), total_training_steps=10)
    assert [f(s) for s in range(4)] == [0.0, 0.5, 1.0, 1.0]
    assert lr_lambda(OptimConfig(), 10)(0) == 1.0  # no warmup: full lr from the first step


def test_cosine_is_verls():
    opt = OptimConfig(lr=1.0, lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    f = lr_lambda(opt, total_training_steps=10)
    assert f(1) == 0.5
    assert f(2) == pytest.approx(1.0)
    assert f(6) == pytest.approx(0.55 + 0.45 * math.cos(math.pi * 0.5))
    assert f(10) == pytest.approx(0.1)


def test_scheduler_and_base_lr_change():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    sched = build_lr_scheduler(optimizer, OptimConfig(lr=0.1, lr_warmup_steps=2), total_training_steps=10)
    assert optimizer.param_groups[0]["lr"] == 0.0
    optimizer.step()
    sched.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    set_base_lr(sched, 0.2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1) and sched.get_last_lr() == [
        pytest.approx(0.1)
    ]
    sched.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
