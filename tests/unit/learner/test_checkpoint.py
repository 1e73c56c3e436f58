import json
import os
import pathlib
import random
import re
import time

import numpy as np
import pytest
import torch

from rlmesh.learner.checkpoints.store import (
    COMPLETE_MARKER,
    CheckpointError,
    capture_rng_state,
    finalize_checkpoint_dir,
    is_complete,
    latest_checkpoint,
    load_checkpoint,
    load_tensors,
    restore_rng_state,
    weights_only_loads,
)


def _complete(path):
    path.mkdir(parents=True)
    (path / COMPLETE_MARKER).write_text("complete\n")


def test_latest_ignores_half_written_and_unmarked(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    assert latest_checkpoint(tmp_path) is None
    _complete(tmp_path / "global_step_2")
    _complete(tmp_path / "global_step_10")
    (tmp_path / "global_step_11").mkdir()  # no marker: written by a run that died
    _complete(tmp_path / "global_step_12.tmp-4242")  # marker but still a temporary name
    assert latest_checkpoint(tmp_path) == str(tmp_path / "global_step_10")
    assert not is_complete(tmp_path / "global_step_11")


def test_latest_without_step_numbers_uses_completion_time(tmp_path):
    _complete(tmp_path / "a")
    time.sleep(0.01)
    _complete(tmp_path / "b")
    os.utime(tmp_path / "a" / COMPLETE_MARKER, (time.time() + 5, time.time() + 5))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "a")


def test_finalize_renames_and_replaces(tmp_path):
    final = tmp_path / "global_step_1"
    _complete(final)
    (final / "old.txt").write_text("old")
    tmp = tmp_path / "global_step_1.tmp-7"
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    finalize_checkpoint_dir(tmp, final)
    assert not tmp.exists() and is_complete(final)
    assert (final / "new.txt").exists() and not (final / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]


def test_prune_keeps_the_newest_and_removes_leftovers_of_dead_saves(tmp_path):
    from rlmesh.learner.checkpoints.store import prune_checkpoints

    for step in (2, 4, 10, 12):
        _complete(tmp_path / f"global_step_{step}")
    _complete(tmp_path / "global_step_14.tmp-4242")  # a save that died before its rename
    (tmp_path / "global_step_12.old-4242").mkdir()  # one that died after moving the old copy aside
    (tmp_path / "global_step_16").mkdir()  # unmarked: not a checkpoint, not ours to judge
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    gone = prune_checkpoints(tmp_path, keep=2)
    assert sorted(os.path.basename(g) for g in gone) == [
        "global_step_12.old-4242",
        "global_step_14.tmp-4242",
        "global_step_2",
        "global_step_4",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_10",
        "global_step_12",
        "global_step_16",
        "metrics.jsonl",
    ]
    assert prune_checkpoints(tmp_path, keep=None) == []  # keep all: nothing left to remove


def test_prune_leaves_the_save_this_process_is_writing_in_the_background(tmp_path):
    from rlmesh.learner.checkpoints.store import prune_checkpoints

    _complete(tmp_path / "global_step_2")
    (tmp_path / f"global_step_4.tmp-{os.getpid()}").mkdir()  # being written by this process
    (tmp_path / "global_step_4.tmp-4242").mkdir()  # another process's, dead
    assert [os.path.basename(g) for g in prune_checkpoints(tmp_path, keep=1)] == ["global_step_4.tmp-4242"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", f"global_step_4.tmp-{os.getpid()}"]


# ----- nothing in a checkpoint is unpickled -----


def test_rng_state_goes_through_json_and_draws_continue_where_they_were():
    random.gauss(0, 1)  # python and numpy hold a cached gaussian: it must survive too
    np.random.standard_normal()
    saved = json.loads(json.dumps(capture_rng_state()))
    want = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), torch.rand(3).tolist())
    restore_rng_state(saved)
    assert (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), torch.rand(3).tolist()) == want


class _Planted:
    """An object whose unpickling would create ``marker``: proof of code run by a load."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_checkpoint_file_holding_an_object_is_refused_naming_it_and_runs_nothing(tmp_path):
    marker = tmp_path / "code-ran"
    bad = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "x": _Planted(marker)}, bad)
    with pytest.raises(CheckpointError, match=re.escape(f"{bad} holds more than tensors")):
        load_tensors(bad)
    # DeepSpeed's own loads ask for weights_only=False: inside, they are refused all the same.
    with weights_only_loads(), pytest.raises(CheckpointError, match=re.escape(str(bad))):
        torch.load(bad, map_location="cpu", weights_only=False)
    assert not marker.exists()
    good = tmp_path / "good.pt"
    torch.save({"module": {"w": torch.ones(2)}, "step": 3, "name": "actor"}, good)
    with weights_only_loads():
        assert torch.load(good, weights_only=False)["step"] == 3
    assert torch.load.__module__ == "torch.serialization"  # given back after the block


def test_a_checkpoint_with_a_pickled_rng_state_is_refused_naming_the_file(tmp_path):
    old = tmp_path / "global_step_4"
    (old / "rng").mkdir(parents=True)
    (old / "rng" / "rank_0.pt").write_bytes(b"a format-1 pickle")
    (old / "trainer_state.json").write_text(json.dumps({"format": 1, "world_size": 1, "zero_stage": {}}))
    (old / COMPLETE_MARKER).write_text("complete\n")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(old, [])
    assert str(old / "rng" / "rank_0.pt") in str(err.value) and "rlmesh export" in str(err.value)


def test_a_snapshot_checkpoint_engine_keeps_the_state_as_it_was_saved(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from rlmesh.learner.checkpoints.background import SnapshotCheckpointEngine

    live = {"module": {"w": torch.ones(3)}, "optimizer": [torch.zeros(2)], "step": 4}
    snapshot = SnapshotCheckpointEngine(TorchCheckpointEngine())
    snapshot.save(live, str(tmp_path / "model.pt"))
    live["module"]["w"].add_(1)  # the next step, while the file waits to be written
    live["optimizer"][0].fill_(7)
    ((kept, path),) = snapshot.files
    assert path == str(tmp_path / "model.pt") and not (tmp_path / "model.pt").exists()
    assert torch.equal(kept["module"]["w"], torch.ones(3)) and torch.equal(
        kept["optimizer"][0], torch.zeros(2)
    )
    snapshot.writer.save(kept, path)  # written later, by the engine it stands in for
    assert torch.equal(torch.load(path, weights_only=True)["module"]["w"], torch.ones(3))
