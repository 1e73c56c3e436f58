"""Which GPUs of a node each process gets: verl's ``trainer.n_gpus_per_node`` split between the
learner's ranks, the rollout replicas (``tensor_model_parallel_size`` GPUs each) and the reference
service. docs/train.md#gpus"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rlmesh.config.schema import RLMeshConfig


class PlacementError(ValueError):
    """The GPUs asked for do not fit the node; the message names the numbers."""


@dataclass(frozen=True)
class GpuSplit:
    ranks: int  # learner ranks, one GPU each (when the learner is on CUDA)
    replicas: int  # rollout replicas, tp GPUs each (when they run SGLang)
    shared: bool = False  # the learner's GPUs are also the replicas': weight sync over gloo


def split_gpus(
    gpus: int,
    *,
    tp: int,
    learner_on_gpu: bool,
    rollout_on_gpu: bool,
    ranks: int | None,
    replicas: int | None,
    reference_gpus: int = 0,
) -> GpuSplit:
    """The learner's ranks and the replicas a node of ``gpus`` GPUs holds; ``ranks`` / ``replicas``:
    what the config set (None: this picks). Unset, the rollout gets half the GPUs (rounded up, at
    least one replica) and the learner the rest: verl colocates the two on every GPU, rlmesh gives
    each its own. Where that leaves either none (1 GPU; 2 GPUs with tp 2), they share the GPUs as
    verl's do: a rank on every GPU and ``gpus // tp`` replicas over the same ones (``shared``: the
    weights then go over gloo). Raises ``PlacementError`` naming the numbers when what the config
    set does not fit, or a replica is wider than the node."""
    have = gpus - reference_gpus
    if have < 1:
        raise PlacementError(
            f"trainer.n_gpus_per_node={gpus} leaves no GPU once the reference takes "
            f"rlmesh.placement.reference_gpus={reference_gpus}"
        )
    ranks_given, replicas_given = ranks is not None, replicas is not None
    if not rollout_on_gpu:
        return GpuSplit(ranks=ranks or (have if learner_on_gpu else 1), replicas=replicas or 1)
    if tp > have:
        raise PlacementError(
            f"a rollout replica of tensor_model_parallel_size={tp} needs {tp} GPUs; trainer.n_gpus_per_node="
            f"{gpus} has {have}{' besides the reference' if reference_gpus else ''}: lower "
            "tensor_model_parallel_size or give the node more GPUs"
        )
    if not learner_on_gpu:
        replicas = replicas or max(1, have // tp)
        ranks = ranks or 1
    elif ranks is None and replicas is None:
        replicas = max(1, (have - have // 2) // tp)
        ranks = have - replicas * tp
    elif ranks is None:
        ranks = have - replicas * tp  # type: ignore[operator]
    elif replicas is None:
        replicas = (have - ranks) // tp
    assert ranks is not None and replicas is not None
    need = (ranks if learner_on_gpu else 0) + replicas * tp
    unset = not (ranks_given or replicas_given)
    if learner_on_gpu and unset and tp <= have and (ranks < 1 or replicas < 1 or need > have):
        return GpuSplit(ranks=have, replicas=have // tp, shared=True)
    if ranks < 1 or replicas < 1 or need > have:
        shown_ranks, shown_replicas = max(ranks, 1), max(replicas, 1)
        total = shown_ranks * learner_on_gpu + shown_replicas * tp + reference_gpus
        used = f"{shown_ranks} learner rank(s)" if learner_on_gpu else "the learner on the CPU"
        reference = f" + rlmesh.placement.reference_gpus={reference_gpus}" if reference_gpus else ""
        raise PlacementError(
            f"trainer.n_gpus_per_node={gpus} does not fit {used} + {shown_replicas} rollout replica(s) x "
            f"tensor_model_parallel_size={tp}{reference} = {total} GPUs; set rlmesh.learner.ranks and "
            f"rlmesh.rollout.replicas so that ranks + replicas x tp{' + reference_gpus' if reference_gpus else ''}"
            f" <= {gpus}, or lower tensor_model_parallel_size"
        )
    return GpuSplit(ranks=ranks, replicas=replicas)


@dataclass(frozen=True)
class Placed:
    name: str  # learner, rollout-<i>, reference
    gpus: tuple[int, ...]  # device ids on the node

    def env(self, visible: list[str] | None = None) -> dict[str, str]:
        """The environment that gives the process exactly its GPUs (SGLang then starts on the first
        of them: its base GPU id stays 0). ``visible``: the launcher's own CUDA_VISIBLE_DEVICES
        entries, which the plan's ids index (None: all of the node's)."""
        ids = [visible[g] if visible is not None else str(g) for g in self.gpus]
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}


@dataclass(frozen=True)
class GpuPlan:
    gpus_per_node: int
    placed: tuple[Placed, ...]
    shared: bool

    def of(self, name: str) -> Placed | None:
        return next((p for p in self.placed if p.name == name), None)

    def describe(self) -> str:
        lines = [f"GPU plan for trainer.n_gpus_per_node={self.gpus_per_node}:"]
        for p in self.placed:
            lines.append(f"  {p.name:<12} GPU {','.join(map(str, p.gpus))}")
        used = sorted({g for p in self.placed for g in p.gpus})
        idle = [g for g in range(self.gpus_per_node) if g not in used]
        if idle:
            lines.append(f"  {'(unused)':<12} GPU {','.join(map(str, idle))}")
        if self.shared:
            lines.append("  the learner's GPUs are also the replicas': weights go over gloo")
        return "\n".join(lines)


def visible_gpus() -> list[str] | None:
    """This process's CUDA_VISIBLE_DEVICES entries, or None where it is unset."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return [v.strip() for v in visible.split(",") if v.strip() and v.strip() != "-1"]


def gpu_count() -> int:
    """The GPUs this process may use, read without importing torch: CUDA_VISIBLE_DEVICES' entries,
    else the NVIDIA driver's list."""
    visible = visible_gpus()
    if visible is not None:
        return len(visible)
    gpus = Path("/proc/driver/nvidia/gpus")
    return sum(1 for _ in gpus.iterdir()) if gpus.is_dir() else 0


def check_fits_machine(plan: GpuPlan, available: int) -> None:
    """Raises ``PlacementError`` when the plan places a process on a GPU the machine lacks."""
    needed = 1 + max(g for p in plan.placed for g in p.gpus)
    if needed > available:
        raise PlacementError(
            f"the GPU plan (trainer.n_gpus_per_node={plan.gpus_per_node}) uses {needed} GPUs but this machine "
            f"has {available} this process may use; set trainer.n_gpus_per_node={available} or free GPUs\n"
            + plan.describe()
        )


def reference_on_gpu(colocated: bool, addresses: object, device: str | None) -> bool:
    """A reference service this job starts (not colocated, none given), on CUDA (``device`` null:
    CUDA where there is one)."""
    return not colocated and not addresses and str(device or "cuda").startswith("cuda")


def plan_gpus(cfg: RLMeshConfig) -> GpuPlan | None:
    """Each GPU process's device ids on a node of ``trainer.n_gpus_per_node`` GPUs, in order: the
    learner's ranks, then each replica's tp GPUs, then the reference's own GPU
    (``rlmesh.placement.reference_gpus``; 0: it shares the learner's first GPU, or the first one).
    None when the job starts nothing on CUDA. Raises ``PlacementError`` when it does not fit."""
    rollout = cfg.actor_rollout_ref.rollout
    gpus, tp = cfg.trainer.n_gpus_per_node, rollout.tensor_model_parallel_size
    learner_on_gpu = cfg.trainer.device == "cuda"
    replicas = cfg.rlmesh.rollout.replicas if rollout.name == "sglang" else 0
    ref = cfg.rlmesh.reference
    reference = reference_on_gpu(ref.colocated, ref.addresses, ref.device)
    reference_gpus = cfg.rlmesh.placement.reference_gpus if reference else 0
    if not (learner_on_gpu or replicas or reference) or gpus < 1:
        return None
    ranks = cfg.rlmesh.learner.ranks if learner_on_gpu else 0
    placed: list[Placed] = []
    if replicas:
        have = gpus - reference_gpus
        if learner_on_gpu and ranks + replicas * tp > have and ranks <= have and replicas * tp <= have:
            # The learner's GPUs are also the replicas' (the split the loader makes where a node is
            # too small to give each its own): NCCL refuses two ranks of one group on one GPU.
            if cfg.rlmesh.weight_sync.backend != "gloo":
                raise PlacementError(
                    f"{ranks} learner rank(s) and {replicas} replica(s) x tensor_model_parallel_size={tp} share "
                    f"trainer.n_gpus_per_node={gpus}: set rlmesh.weight_sync.backend=gloo (NCCL refuses two "
                    "ranks of one group on one GPU), or fewer ranks and replicas"
                )
            placed = [Placed("learner", tuple(range(ranks)))]
            placed += [Placed(f"rollout-{i}", tuple(range(i * tp, (i + 1) * tp))) for i in range(replicas)]
            if reference:
                placed.append(Placed("reference", (have,) if reference_gpus else (0,)))
            return GpuPlan(gpus, tuple(placed), shared=True)
        split_gpus(  # raises, naming the numbers, when they do not fit
            gpus,
            tp=tp,
            learner_on_gpu=learner_on_gpu,
            rollout_on_gpu=True,
            ranks=max(ranks, 1),
            replicas=replicas,
            reference_gpus=reference_gpus,
        )
    elif ranks + reference_gpus > gpus:
        raise PlacementError(
            f"trainer.n_gpus_per_node={gpus} does not fit {ranks} learner rank(s)"
            + (f" + rlmesh.placement.reference_gpus={reference_gpus}" if reference_gpus else "")
        )
    next_gpu = 0
    if ranks:
        placed.append(Placed("learner", tuple(range(ranks))))
        next_gpu = ranks
    for i in range(replicas):
        placed.append(Placed(f"rollout-{i}", tuple(range(next_gpu, next_gpu + tp))))
        next_gpu += tp
    if reference:
        own = (next_gpu,) if reference_gpus else (0,)
        placed.append(Placed("reference", own))
    return GpuPlan(gpus, tuple(placed), shared=False)
