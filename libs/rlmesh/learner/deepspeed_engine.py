"""DeepSpeed configuration and engine construction for the actor and the critic.

docs/design.md#learner-ranks"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch

from rlmesh.config import EngineSettings, OptimConfig

__all__ = ["build_engine", "deepspeed_config"]


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
        # A torch AdamW with offloaded optimizer states is slower than DeepSpeedCPUAdam but needs
        # no compiled op; allow it instead of failing.
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def build_engine(
    model: torch.nn.Module, optim: OptimConfig, settings: EngineSettings, grad_clip: float, world_size: int
) -> tuple[deepspeed.DeepSpeedEngine, torch.optim.Optimizer]:
    """``deepspeed.initialize`` with an AdamW over the trainable parameters.

    AdamW as verl builds it: ``lr``, ``betas``, ``weight_decay`` from ``optim``, eps 1e-8, weight
    decay on every parameter; its multi-tensor (``foreach``) implementation, which computes what the
    per-tensor loop computes (bit for bit) in fewer kernel calls, also on CPU where torch would
    pick the loop.

    On one rank a stage-0 fp32 engine skips its gradient all-reduce: it would flatten every
    gradient, divide it by 1, sum it over one rank and copy it back.

    Returns:
        the engine, and the AdamW itself: DeepSpeed's wrappers step it with its own
        ``param_groups``, so an lr scheduler built on it sets the lr the engine uses.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, eps=1e-8, foreach=True
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(settings, grad_clip, world_size)
    )
    if world_size == 1 and settings.zero_stage == 0 and settings.dtype == "float32":
        engine.enable_backward_allreduce = False
    return engine, optimizer
