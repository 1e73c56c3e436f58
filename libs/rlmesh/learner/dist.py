"""torch.distributed for the learner: one process group over the data-parallel ranks.

docs/design.md#learner-ranks"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlmesh.weights.group import pinned_gloo_interface

__all__ = [
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "init_distributed",
    "rank",
    "shutdown_distributed",
    "world_size",
]

log = logging.getLogger("rlmesh.learner")


def _skip_shm_comm_build() -> None:
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op on the first
    # init_distributed of a machine (35-75 s here). That op only serves DeepSpeed-Inference's
    # tensor-parallel all-reduce, which training never calls: skip the build unless asked for.
    if os.environ.get("RLMESH_DS_SHM_COMM", "0") == "1":
        return
    # importlib: the attribute deepspeed.comm.torch can be the torch package itself.
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_torch_comm, "build_shm_op"):
        ds_torch_comm.build_shm_op = lambda: None


def learner_device(requested: str, cuda_available: bool) -> str:
    """``trainer.device`` as this machine can honour it: ``cuda`` falls back to ``cpu`` (with a
    warning) where there is no CUDA device; ``cpu`` trains on the CPU even beside GPUs."""
    if requested == "cuda" and not cuda_available:
        log.warning("trainer.device=cuda but this machine has no CUDA device: the learner trains on the CPU")
        return "cpu"
    return requested


def init_distributed(backend: str | None = None, timeout_s: float = 600.0, device: str = "cuda") -> None:
    """Join (or create) the learner's process group; idempotent.

    Under a launcher (``RANK``/``WORLD_SIZE`` in the environment) the group is the launcher's.
    Otherwise this process is a group of one that listens on loopback only; only ``LOCAL_RANK=0`` is
    put into the environment (DeepSpeed insists on it), so child processes inherit no rendezvous.

    Args:
        backend: ``gloo`` or ``nccl``; default NCCL on CUDA, gloo otherwise.
        device: ``trainer.device``; ``cpu`` keeps the learner (and DeepSpeed) off the GPUs.
        timeout_s: how long any collective of the group may wait for the other ranks before it
            fails (verl's ``actor_rollout_ref.nccl_timeout``); torch's default is 30 minutes.
    """
    import deepspeed

    on_cuda = learner_device(device, torch.cuda.is_available()) == "cuda"
    if not on_cuda:
        from deepspeed.accelerator import get_accelerator, set_accelerator

        if get_accelerator().device_name() != "cpu":
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

            set_accelerator(CPU_Accelerator())
    if backend is None:
        backend = "nccl" if on_cuda else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        _skip_shm_comm_build()
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    if on_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized() and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        # A group of one: an in-process store and gloo on loopback, so nothing of it listens beyond
        # this machine (a tcp:// rendezvous's store listens on every interface).
        with pinned_gloo_interface("lo" if backend == "gloo" else None):
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    # With a group in place DeepSpeed only registers it with deepspeed.comm; under a launcher it
    # creates the group, with this timeout.
    deepspeed.init_distributed(
        dist_backend=dist.get_backend() if dist.is_initialized() else backend, timeout=timeout
    )
    _shutdown_at_exit()
    log.info("learner rank %d of %d in the process group (%s)", rank(), world_size(), dist.get_backend())


def shutdown_distributed() -> None:
    """Destroys every process group and joins their threads; idempotent. Runs at exit too (see
    ``_shutdown_at_exit``); ``os._exit`` skips it, for a rank that must not wait on its peers."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_registered_at_exit = False


def _shutdown_at_exit() -> None:
    # Left alive into the interpreter's finalization, a gloo worker thread can still be dropping
    # the last reference to a collective's tensors (likely when the rank exits right after that
    # collective, e.g. because it failed); freeing them takes the GIL, which a finalizing
    # interpreter refuses by ending the thread inside a C++ destructor: "terminate called without
    # an active exception", exit -6 instead of the rank's own code. atexit handlers run before
    # finalization, on every exit path but os._exit.
    global _registered_at_exit
    if not _registered_at_exit:
        atexit.register(shutdown_distributed)
        _registered_at_exit = True


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over the ranks (a no-op with one rank); returns ``tensor``.

    NCCL reduces device tensors only: a CPU tensor makes a round trip through the current GPU.
    """
    if world_size() == 1:
        return tensor
    if dist.get_backend() == "nccl" and tensor.device.type == "cpu":
        on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
        tensor.copy_(on_device.cpu())
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` has it, on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
