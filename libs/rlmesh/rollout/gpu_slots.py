"""A replica's own GPUs where replicas share a pool (compose's `--scale rollout=N`): it claims
``tp`` of the GPUs it sees, by UUID, under a lease in Redis. docs/train.md#gpus"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from rlmesh.queue.keys import RunKeys
from rlmesh.queue.lease import LeaseHeldError, RunLease


class NoFreeGpusError(RuntimeError):
    """Every slot of the pool is held by a live replica; the message names the numbers."""


def parse_gpu_uuids(nvidia_smi_l: str) -> list[str]:
    """The UUIDs in ``nvidia-smi -L`` output (``GPU 0: NVIDIA H200 (UUID: GPU-8c1f...)``), in order."""
    uuids = []
    for line in nvidia_smi_l.splitlines():
        _, sep, rest = line.partition("(UUID: ")
        if sep:
            uuids.append(rest.split(")", 1)[0].strip())
    return uuids


def visible_gpu_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees (a container sees the ones it reserved), without
    touching CUDA: a replica starts no CUDA context of its own beside its SGLang."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return parse_gpu_uuids(out.stdout) if out.returncode == 0 else []


def gpu_slots(uuids: Sequence[str], tp: int) -> list[list[str]]:
    """The pool cut into consecutive slots of ``tp`` GPUs (a remainder smaller than tp is unused)."""
    return [list(uuids[i : i + tp]) for i in range(0, len(uuids) - tp + 1, tp)]


@dataclass
class GpuClaim:
    """A slot held: its UUIDs (CUDA_VISIBLE_DEVICES takes them as they are) and its lease, renewed
    from the claim on (an SGLang start can outlast many leases) until ``release``."""

    gpus: list[str]
    lease: RunLease
    keeper: asyncio.Task[None] = field(init=False)

    def __post_init__(self) -> None:
        self.keeper = asyncio.create_task(self.lease.keep())

    async def release(self) -> None:
        self.keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.keeper
        await self.lease.release()


async def claim_gpus(
    redis: aioredis.Redis, keys: RunKeys, uuids: Sequence[str], tp: int, lease_s: float
) -> GpuClaim:
    """Takes the first free slot of ``tp`` GPUs among ``uuids`` (a dead replica's slot frees when its
    lease runs out); ``NoFreeGpusError`` when live replicas hold them all."""
    slots = gpu_slots(uuids, tp)
    for slot in slots:
        lease = RunLease(redis, keys.scoped(f"gpus:{slot[0]}"), lease_s, what="rollout replica")
        try:
            await lease.acquire(wait_s=0)
        except LeaseHeldError:
            continue
        return GpuClaim(slot, lease)
    raise NoFreeGpusError(
        f"this replica sees {len(uuids)} GPU(s), {len(slots)} slot(s) of tensor_model_parallel_size={tp}, and "
        "live replicas of this run hold every one: reserve more GPUs for the rollout service or run fewer "
        "replicas (a dead replica's slot frees when its lease runs out)"
    )
