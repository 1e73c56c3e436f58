import os
import time

from rlmesh.learner.checkpoint import COMPLETE_MARKER, finalize_checkpoint_dir, is_complete, latest_checkpoint


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
    from rlmesh.learner.checkpoint import prune_checkpoints

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
