"""Atomic learner checkpoints: written by all ranks into a temporary directory, renamed when complete;
never unpickled (tensors load with weights_only=True, RNG and trainer state are JSON).
docs/reliability.md#checkpoints"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from rlmesh.learner.checkpoints.background import CheckpointWriter

__all__ = [
    "COMPLETE_MARKER",
    "CheckpointError",
    "capture_rng_state",
    "finalize_checkpoint_dir",
    "is_complete",
    "latest_checkpoint",
    "load_checkpoint",
    "load_tensors",
    "prune_checkpoints",
    "restore_rng_state",
    "save_checkpoint",
    "weights_only_loads",
]

# 2: RNG state in rng/rank_<r>.json. 1 pickled it (rng/rank_<r>.pt), and is not loaded.
FORMAT = 2
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


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step a checkpoint was saved at (``extra_state.step`` of its ``trainer_state.json``);
    raises ``OSError``, ``ValueError``, ``KeyError`` or ``TypeError`` when that does not read."""
    return int(json.loads((Path(path) / "trainer_state.json").read_text())["extra_state"]["step"])


def prune_checkpoints(root: str | os.PathLike[str], keep: int | None) -> list[str]:
    """After a save (rank 0): deletes the complete checkpoints under ``root`` beyond the newest
    ``keep`` (None: keeps all) and every leftover of a save that died half-way (``.tmp-`` /
    ``.old-`` directories), but this process's own (a save it is writing in the background).
    Returns what it deleted."""
    base = Path(root)
    if not base.is_dir():
        return []
    own = (f"{TMP_INFIX}{os.getpid()}", f"{OLD_INFIX}{os.getpid()}")
    gone = [
        p
        for p in base.iterdir()
        if p.is_dir() and (TMP_INFIX in p.name or OLD_INFIX in p.name) and not p.name.endswith(own)
    ]
    if keep is not None:
        done = sorted((p for p in base.iterdir() if p.is_dir() and is_complete(p)), key=_order_key)
        gone += done[: max(0, len(done) - keep)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return [str(p) for p in gone]


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and, when present, CUDA) RNG states of this process, as JSON
    data: the Mersenne Twister words as numbers, torch's generator bytes in base64."""
    version, words, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(words), "gauss_next": gauss_next},
        "numpy": {
            "kind": str(kind),
            "keys": np.asarray(keys).tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """The inverse of :func:`capture_rng_state` (from its JSON)."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(w) for w in py["state"]), py["gauss_next"]))
    n = state["numpy"]
    keys = np.asarray(n["keys"], dtype=np.uint32)
    np.random.set_state((n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"])))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))


def _deepspeed_classes() -> list[type]:
    # Besides tensors and containers, DeepSpeed's optimizer states hold these plain classes: its
    # loss scalers (numbers), the ZeRO stage enum and a parameter fragment's (numel, start). They
    # are the only classes a load builds.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


_torch_load = torch.load  # the real one, while weights_only_loads() stands in for it


def load_tensors(f: Any, map_location: Any = "cpu", *, mmap: bool | None = None) -> Any:
    """``torch.load(f, weights_only=True)``: tensors, containers, numbers and strings (and
    DeepSpeed's few plain classes), never code.

    Raises:
        CheckpointError: ``f`` holds anything else (a pickled object), naming the file.
    """
    with torch.serialization.safe_globals(_deepspeed_classes()):
        try:
            return _torch_load(f, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            # torch's message says how to load it anyway; only its reason belongs here.
            reason = re.search(r"WeightsUnpickler error: (.*?\.)(\s|$)", str(e))
            where = os.fspath(f) if isinstance(f, str | os.PathLike) else getattr(f, "name", repr(f))
            raise CheckpointError(
                f"{where} holds more than tensors and is not loaded (unpickling it could "
                f"run code): {reason.group(1) if reason else type(e).__name__}"
            ) from e


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every ``torch.load`` inside goes through :func:`load_tensors`, DeepSpeed's own included (it
    asks for ``weights_only=False``)."""

    def load(f: Any, map_location: Any = None, *_: Any, mmap: bool | None = None, **__: Any) -> Any:
        return load_tensors(f, map_location, mmap=mmap)

    torch.load = load  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load = _torch_load


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
    """Rank 0, after every rank wrote into ``tmp``: mark it complete and move it to ``path`` (an
    existing one, the same step saved again, replaced: ``replace_dir``)."""
    tmp, path = Path(tmp), Path(path)
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync_file(f)
    marker = tmp / COMPLETE_MARKER
    marker.write_text("complete\n")
    _fsync_file(marker)
    _fsync_dir(tmp)
    replace_dir(tmp, path)


def replace_dir(tmp: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Moves the directory ``tmp`` to ``path``; an existing ``path`` is moved aside first and deleted
    after the rename, so at every instant one complete copy exists."""
    tmp, path = Path(tmp), Path(path)
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
    path: str | os.PathLike[str],
    engines: Engines,
    state: dict[str, Any],
    config_yaml: str,
    writer: CheckpointWriter | None = None,
) -> None:
    """Write a complete checkpoint at ``path`` (collective: every rank, same arguments).

    Args:
        path: the directory to create (an existing one is replaced atomically).
        engines: each is saved with DeepSpeed (optimizer partitions included), its scheduler's
            state in the client state.
        state: JSON-serialisable trainer state for ``trainer_state.json``.
        config_yaml: the run's config.
        writer: given, DeepSpeed's files are snapshotted into host memory and written by it in
            the background (``rlmesh.learner.checkpoints.background``): this returns once the
            snapshot is taken, and ``path`` appears, complete, when the write is done. A save
            waits for the one before it.
    """
    # Here, not at the top: `rlmesh train` reads checkpoints without importing DeepSpeed.
    from rlmesh.learner.checkpoints.background import remove_marker_dir, snapshotting
    from rlmesh.learner.dist import barrier, broadcast_object, rank, world_size

    json.dumps(state)  # fail before any collective work when it cannot be saved
    if writer is not None:
        writer.wait()  # every rank, before the barriers below: never two in flight
    final = Path(path)
    tmp = final.with_name(f"{final.name}{TMP_INFIX}{broadcast_object(os.getpid())}")
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    barrier()
    files = []
    for name, engine, scheduler in engines:
        with snapshotting(engine) if writer is not None else contextlib.nullcontext() as snapshot:
            engine.save_checkpoint(
                str(tmp / name), tag="state", client_state={"lr_scheduler": scheduler.state_dict()}
            )
        if snapshot is not None:
            files += [(state_dict, file, snapshot.writer) for state_dict, file in snapshot.files]
    (tmp / "rng" / f"rank_{rank()}.json").write_text(json.dumps(capture_rng_state()))
    barrier()
    if rank() == 0:
        stages = {name: int(engine.zero_optimization_stage()) for name, engine, _ in engines}
        write_json_durably(
            tmp / "trainer_state.json",
            {"format": FORMAT, "world_size": world_size(), "zero_stage": stages, **state},
        )
        (tmp / "config.yaml").write_text(config_yaml)
        if writer is None:
            finalize_checkpoint_dir(tmp, final)
    if writer is not None:

        def finalize() -> None:
            remove_marker_dir(tmp)
            finalize_checkpoint_dir(tmp, final)

        writer.start(files, tmp, rank(), finalize if rank() == 0 else None, world_size())
    barrier()


def load_checkpoint(path: str | os.PathLike[str], engines: Engines) -> dict[str, Any]:
    """Restore engines (weights, optimizer states), schedulers and this rank's RNG from ``path``;
    returns the trainer state saved with it. Collective.

    Raises:
        CheckpointError: not a complete checkpoint, written with another world size (ZeRO
            partitions do not reshard) or other ZeRO stages, or in format 1 (a pickled RNG state).
    """
    from rlmesh.learner.dist import barrier, rank, world_size
    from rlmesh.learner.ppo.schedule import set_base_lr

    base = Path(path)
    if not is_complete(base):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    state = json.loads((base / "trainer_state.json").read_text())
    rng_file = base / "rng" / f"rank_{rank()}.json"
    pickled = rng_file.with_suffix(".pt")
    if not rng_file.is_file() and pickled.is_file():
        raise CheckpointError(
            f"{pickled}: {path} is a checkpoint of format 1 (its RNG state pickled), which is not "
            "loaded: unpickling could run code. Start from its weights instead: `rlmesh export` it "
            "and point actor_rollout_ref.model.path at the export"
        )
    if not rng_file.is_file():
        raise CheckpointError(f"{path} has no RNG state for rank {rank()} ({rng_file})")
    stages = {name: int(engine.zero_optimization_stage()) for name, engine, _ in engines}
    if state["world_size"] != world_size() and any(stages.values()):
        raise CheckpointError(
            f"{path} was written by {state['world_size']} ranks; its ZeRO partitions cannot be loaded by "
            f"{world_size()} (export it with `rlmesh export` and start from the HF directory)"
        )
    if state["zero_stage"] != stages:
        raise CheckpointError(f"{path} has ZeRO stages {state['zero_stage']}; this run uses {stages}")
    for name, engine, scheduler in engines:
        with weights_only_loads():
            load_path, client_state = engine.load_checkpoint(
                str(base / name), tag="state", load_optimizer_states=True, load_lr_scheduler_states=False
            )
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found no {name} checkpoint under {base / name}")
        scheduler.load_state_dict(client_state["lr_scheduler"])
        set_base_lr(scheduler, scheduler.base_lrs[0])  # the optimizer takes the restored step's lr
    restore_rng_state(json.loads(rng_file.read_text()))
    barrier()
    return state
