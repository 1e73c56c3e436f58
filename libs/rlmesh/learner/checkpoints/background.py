"""Checkpoints written in the background: DeepSpeed's files are snapshotted into host memory while
the step waits, and written, marked complete and renamed into place by a thread while training goes
on. Never two in flight. docs/reliability.md#checkpoints"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

log = logging.getLogger("rlmesh.learner")

WRITTEN_DIR = "written"  # rank r's marker, once its files are on disk: written/rank_<r>
RANKS_WAIT_S = 600.0  # rank 0's wait for the others' files before it gives a checkpoint up


class SnapshotCheckpointEngine(CheckpointEngine):
    """Stands in for a DeepSpeed engine's checkpoint engine during one ``save_checkpoint``: each
    file's state is copied to host memory (the live tensors change with the next step) and kept,
    to be written later by the engine it stands in for, in that engine's format."""

    def __init__(self, writer: CheckpointEngine) -> None:
        super().__init__()
        self.writer = writer
        self.files: list[tuple[Any, str]] = []

    def create(self, info: Any) -> None:
        pass

    def save(self, state_dict: Any, path: str) -> None:
        self.files.append((clone_tensors_for_torch_save(state_dict), path))

    def load(self, path: str, map_location: Any = None) -> Any:
        return self.writer.load(path, map_location)

    def commit(self, info: Any) -> bool:
        return True


@contextmanager
def snapshotting(engine: Any) -> Iterator[SnapshotCheckpointEngine]:
    """``engine.save_checkpoint`` inside snapshots its files instead of writing them."""
    original = engine.checkpoint_engine
    snapshot = SnapshotCheckpointEngine(original)
    engine.checkpoint_engine = snapshot
    try:
        yield snapshot
    finally:
        engine.checkpoint_engine = original


class CheckpointWriter:
    """This rank's background writes: one checkpoint at a time. A write that failed raises at the
    next ``wait`` (the next save, or the run's end), as a synchronous save would have raised."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.written_s = 0.0  # how long the last checkpoint took to write, start to complete

    def wait(self) -> None:
        """Until the checkpoint in flight is written (at once when none is)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the last checkpoint's background write failed: {error}") from error

    def start(
        self,
        files: list[tuple[Any, str, CheckpointEngine]],
        tmp: Path,
        rank: int,
        finalize: Callable[[], None] | None,
        world: int,
    ) -> None:
        """Writes ``files`` (state, path, the engine that writes it), then this rank's marker under
        ``tmp``; rank 0 (``finalize`` given) then waits for every rank's marker and finalizes."""

        def write() -> None:
            for state, path, engine in files:
                engine.save(state, path)
            files.clear()  # the snapshot's memory goes now, not at the next checkpoint
            (tmp / WRITTEN_DIR).mkdir(exist_ok=True)
            (tmp / WRITTEN_DIR / f"rank_{rank}").write_text("written\n")
            if finalize is not None:
                wait_for_ranks(tmp, world)
                finalize()

        self.wait()  # never two in flight
        self._thread = threading.Thread(
            target=self._run, args=(write, tmp), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def _run(self, write: Callable[[], None], tmp: Path) -> None:
        t0 = time.monotonic()
        try:
            write()
            self.written_s = time.monotonic() - t0
        except BaseException as e:  # raised at the next wait, on the trainer's thread
            log.error("checkpoint %s: background write failed: %s", tmp, e)
            self._error = e


def wait_for_ranks(tmp: Path, world: int, timeout_s: float = RANKS_WAIT_S) -> None:
    """Rank 0: until every rank's marker is under ``tmp`` (their writes run side by side)."""
    deadline = time.monotonic() + timeout_s
    markers = [tmp / WRITTEN_DIR / f"rank_{r}" for r in range(world)]
    while not all(m.exists() for m in markers):
        if time.monotonic() > deadline:
            missing = [m.name for m in markers if not m.exists()]
            raise TimeoutError(f"{', '.join(missing)} did not write their part within {timeout_s:.0f} s")
        time.sleep(0.05)  # polls the file system: the ranks share no channel but the checkpoint dir


def remove_marker_dir(tmp: Path) -> None:
    """The markers are the write's, not the checkpoint's."""
    for marker in (tmp / WRITTEN_DIR).glob("rank_*"):
        os.unlink(marker)
    (tmp / WRITTEN_DIR).rmdir()
