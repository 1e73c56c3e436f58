"""Atomic learner checkpoints: written by all ranks into a temporary directory, renamed when complete.

docs/reliability.md#checkpoints"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "COMPLETE_MARKER",
    "CheckpointError",
    "capture_rng_state",
    "finalize_checkpoint_dir",
    "is_complete",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "restore_rng_state",
    "save_checkpoint",
]

FORMAT = 1
COMPLETE_MARKER = "COMPLETE"
TMP_INFIX = ".tmp-"
OLD_INFIX = ".old-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, incomplete, or from an incompatible run)."""


def is_complete(path: str | os.PathLike[str]) -> bool:
    """True for a finished checkpoint directory (``COMPLETE`` present, not a temporary name)."""
    p = Path(path)
    return TMP_INFIX not in p.name and OLD_INFIX not in p.name and (p / COMPLETE_MARKER).is_file()


def _order_key(path: Path) -> tuple[int, float]:
    # Step number when the name ends in one (global_step_12), then the time COMPLETE was written.
    match = re.search(r"(\d+)$", path.name)
    return (int(match.group(1)) if match else -1, (path / COMPLETE_MARKER).stat().st_mtime)


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint directly under ``root`` (highest trailing step number, then
    newest ``COMPLETE``), or None. Half-written (``.tmp-``) and unmarked directories never count."""
    base = Path(root)
    if not base.is_dir():
        return None
    done = [p for p in base.iterdir() if p.is_dir() and is_complete(p)]
    return str(max(done, key=_order_key)) if done else None


def prune_checkpoints(root: str | os.PathLike[str], keep: int | None) -> list[str]:
    """After a save (rank 0, no save running): deletes the complete checkpoints under ``root``
    beyond the newest ``keep`` (None: keeps all) and every leftover of a save that died half-way
    (``.tmp-`` / ``.old-`` directories). Returns what it deleted."""
    base = Path(root)
    if not base.is_dir():
        return []
    gone = [p for p in base.iterdir() if p.is_dir() and (TMP_INFIX in p.name or OLD_INFIX in p.name)]
    if keep is not None:
        done = sorted((p for p in base.iterdir() if p.is_dir() and is_complete(p)), key=_order_key)
        gone += done[: max(0, len(done) - keep)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return [str(p) for p in gone]


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and, when present, CUDA) RNG states of this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    _fsync_file(path)


def finalize_checkpoint_dir(tmp: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Rank 0, after every rank wrote into ``tmp``: mark it complete and move it to ``path``.

    An existing ``path`` (the same step saved again) is moved aside first and deleted after the
    rename, so at every instant one complete copy exists.
    """
    tmp, path = Path(tmp), Path(path)
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync_file(f)
    marker = tmp / COMPLETE_MARKER
    marker.write_text("complete\n")
    _fsync_file(marker)
    _fsync_dir(tmp)
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}{OLD_INFIX}{os.getpid()}")
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


Engines = list[tuple[str, Any, Any]]  # (name, DeepSpeed engine, its lr scheduler)


def save_checkpoint(
    path: str | os.PathLike[str], engines: Engines, state: dict[str, Any], config_yaml: str
) -> None:
    """Write a complete checkpoint at ``path`` (collective: every rank, same arguments).

    Args:
        path: the directory to create (an existing one is replaced atomically).
        engines: each is saved with DeepSpeed (optimizer partitions included), its scheduler's
            state in the client state.
        state: JSON-serialisable trainer state for ``trainer_state.json``.
        config_yaml: the run's config.
    """
    from rlmesh.learner.dist import barrier, broadcast_object, rank, world_size

    json.dumps(state)  # fail before any collective work when it cannot be saved
    final = Path(path)
    tmp = final.with_name(f"{final.name}{TMP_INFIX}{broadcast_object(os.getpid())}")
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    barrier()
    for name, engine, scheduler in engines:
        engine.save_checkpoint(
            str(tmp / name), tag="state", client_state={"lr_scheduler": scheduler.state_dict()}
        )
    torch.save(capture_rng_state(), tmp / "rng" / f"rank_{rank()}.pt")
    barrier()
    if rank() == 0:
        stages = {name: int(engine.zero_optimization_stage()) for name, engine, _ in engines}
        write_json_durably(
            tmp / "trainer_state.json",
            {"format": FORMAT, "world_size": world_size(), "zero_stage": stages, **state},
        )
        (tmp / "config.yaml").write_text(config_yaml)
        finalize_checkpoint_dir(tmp, final)
    barrier()


def load_checkpoint(path: str | os.PathLike[str], engines: Engines) -> dict[str, Any]:
    """Restore engines (weights, optimizer states), schedulers and this rank's RNG from ``path``;
    returns the trainer state saved with it. Collective.

    Raises:
        CheckpointError: not a complete checkpoint, or written with another world size (ZeRO
            partitions do not reshard) or other ZeRO stages.
    """
    from rlmesh.learner.dist import barrier, rank, world_size
    from rlmesh.learner.schedule import set_base_lr

    base = Path(path)
    if not is_complete(base):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    state = json.loads((base / "trainer_state.json").read_text())
    stages = {name: int(engine.zero_optimization_stage()) for name, engine, _ in engines}
    if state["world_size"] != world_size() and any(stages.values()):
        raise CheckpointError(
            f"{path} was written by {state['world_size']} ranks; its ZeRO partitions cannot be loaded by "
            f"{world_size()} (export it with `rlmesh export` and start from the HF directory)"
        )
    if state["zero_stage"] != stages:
        raise CheckpointError(f"{path} has ZeRO stages {state['zero_stage']}; this run uses {stages}")
    for name, engine, scheduler in engines:
        load_path, client_state = engine.load_checkpoint(
            str(base / name), tag="state", load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found no {name} checkpoint under {base / name}")
        scheduler.load_state_dict(client_state["lr_scheduler"])
        set_base_lr(scheduler, scheduler.base_lrs[0])  # the optimizer takes the restored step's lr
    restore_rng_state(torch.load(base / "rng" / f"rank_{rank()}.pt", weights_only=False))
    barrier()
    return state
