"""Learning-rate schedules, verl's: linear warmup, then constant or cosine.

docs/internals.md#rlmeshlearnerpposchedule"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from rlmesh.config import OptimConfig

__all__ = ["build_lr_scheduler", "lr_lambda", "set_base_lr"]


def lr_lambda(optim: OptimConfig, total_training_steps: int) -> Callable[[int], float]:
    """The lr multiplier at step ``s`` (``lr_s = optim.lr * f(s)``).

    With ``W = optim.warmup_steps(total)`` and ``T = total``:

    - constant: ``f(s) = s / max(1, W)`` for ``s < W``, else 1
      (verl's ``get_constant_schedule_with_warmup``)
    - cosine: ``f(s) = s / max(1, W)`` for ``s < W``, else
      ``max(m, c·cos(2π·cycles·p) + i)`` with ``p = (s - W) / max(1, T - W)``,
      ``c = (1 - m)/2``, ``i = (1 + m)/2``, ``m = min_lr_ratio``
      (verl's ``get_cosine_schedule_with_warmup``)
    """
    warmup = optim.warmup_steps(total_training_steps)
    if optim.lr_scheduler_type == "constant":

        def constant(step: int) -> float:
            if step < warmup:
                return float(step) / float(max(1.0, warmup))
            return 1.0

        return constant
    min_lr_ratio = 0.0 if optim.min_lr_ratio is None else optim.min_lr_ratio
    coef = (1 - min_lr_ratio) * 0.5
    intercept = (1 + min_lr_ratio) * 0.5
    cycles = optim.num_cycles

    def cosine(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total_training_steps - warmup))
        return max(min_lr_ratio, math.cos(math.pi * float(cycles) * 2.0 * progress) * coef + intercept)

    return cosine


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, total_training_steps: int
) -> LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` with :func:`lr_lambda`; step it once per PPO step."""
    return LambdaLR(optimizer, lr_lambda(optim, total_training_steps))


def set_base_lr(scheduler: LambdaLR, lr: float) -> None:
    """Make ``lr`` the peak learning rate; the optimizer's current lr follows at once (the
    schedule's multiplier for the current step is kept)."""
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    last = []
    for group, fn in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["lr"] = lr * fn(scheduler.last_epoch)
        last.append(group["lr"])
    scheduler._last_lr = last  # what get_last_lr() reports
