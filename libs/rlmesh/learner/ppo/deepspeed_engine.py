"""DeepSpeed configuration and engine construction for the actor and the critic.

docs/design.md#learner-ranks"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import deepspeed
import torch

from rlmesh.config import EngineSettings, OptimConfig

__all__ = ["build_engine", "build_optimizer", "deepspeed_config"]

log = logging.getLogger("rlmesh.learner")


def deepspeed_config(settings: EngineSettings, grad_clip: float, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config dict for one model.

    Args:
        settings: ZeRO stage, offload flags and dtype (``actor.effective_engine()``).
        grad_clip: max global gradient norm; 0 = no clipping.
        world_size: data-parallel ranks.
    """
    zero: dict[str, Any] = {"stage": settings.zero_stage}
    if settings.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if settings.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if settings.zero_stage == 3:
        # Full weights for pushes/exports are gathered bucket by bucket, never here.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": float(grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": settings.dtype == "bfloat16"},
        "fp16": {"enabled": settings.dtype == "float16"},
        # build_optimizer gives offloaded states DeepSpeedCPUAdam; where its op cannot be built,
        # torch's AdamW (multi-threaded for the step) instead of failing.
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def with_threads(step: Callable[..., Any], threads: int) -> Callable[..., Any]:
    """``step`` run with ``threads`` OpenMP/intra-op threads, then the process's own count again:
    every learner process runs on one thread (OMP_NUM_THREADS=1), which would leave a CPU
    optimizer step on one core."""

    @functools.wraps(step)
    def stepped(*args: Any, **kwargs: Any) -> Any:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return step(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return stepped


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optim: OptimConfig, *, offload: bool, threads: int = 0
) -> torch.optim.Optimizer:
    """AdamW as verl builds it: ``lr``, ``betas``, ``weight_decay`` from ``optim``, eps 1e-8, weight
    decay on every parameter. torch's multi-tensor (``foreach``) AdamW, which computes what the
    per-tensor loop computes (bit for bit) in fewer kernel calls, also on CPU where torch would pick
    the loop. With ``offload`` (ZeRO's optimizer states on the CPU) DeepSpeed's CPU Adam (SIMD,
    OpenMP; the AdamW update in fp32), as verl's DeepSpeed and OpenRLHF configs use, stepped on
    ``threads`` threads (0: every core this process may use); torch's AdamW on as many threads where
    that op cannot be built (no compiler)."""
    params = list(params)
    kwargs = {"lr": optim.lr, "betas": tuple(optim.betas), "weight_decay": optim.weight_decay, "eps": 1e-8}
    if not offload:
        return torch.optim.AdamW(params, foreach=True, **kwargs)
    threads = threads or len(os.sched_getaffinity(0))
    optimizer: torch.optim.Optimizer
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    except Exception as e:  # the op is compiled on first use: no compiler, no headers, ...
        log.warning(
            "DeepSpeed's CPU Adam cannot be built here (%s): torch's AdamW steps the offloaded states", e
        )
        optimizer = torch.optim.AdamW(params, foreach=True, **kwargs)
    optimizer.step = with_threads(optimizer.step, threads)  # type: ignore[method-assign]
    return optimizer


def build_engine(
    model: torch.nn.Module,
    optim: OptimConfig,
    settings: EngineSettings,
    grad_clip: float,
    world_size: int,
    optimizer_threads: int = 0,
) -> tuple[deepspeed.DeepSpeedEngine, torch.optim.Optimizer]:
    """``deepspeed.initialize`` with ``build_optimizer``'s AdamW over the trainable parameters.

    On one rank a stage-0 fp32 engine skips its gradient all-reduce: it would flatten every
    gradient, divide it by 1, sum it over one rank and copy it back.

    Returns:
        the engine, and the AdamW itself: DeepSpeed's wrappers step it with its own
        ``param_groups``, so an lr scheduler built on it sets the lr the engine uses.
    """
    optimizer = build_optimizer(
        (p for p in model.parameters() if p.requires_grad),
        optim,
        offload=settings.offload_optimizer,
        threads=optimizer_threads,
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(settings, grad_clip, world_size)
    )
    if world_size == 1 and settings.zero_stage == 0 and settings.dtype == "float32":
        engine.enable_backward_allreduce = False
    return engine, optimizer
