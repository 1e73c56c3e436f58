"""A checkpoint written in the background (``save_checkpoint(background=True)``) holds the state of
the moment it was taken, though training goes on while it is written, and loads like one written
in the step."""

from __future__ import annotations

import os

import torch

from rlmesh.learner import build_batch
from rlmesh.learner.checkpoints.store import is_complete
from tests.support.learner import PAD, ckpt_snapshot, ckpt_trainer, make_trajectories


def test_a_background_checkpoint_holds_the_state_it_was_taken_at(tiny_model_dir, tmp_path):
    trainer = ckpt_trainer(tiny_model_dir)
    metrics = trainer.train_step(build_batch(make_trajectories(seed=11), PAD))
    taken = ckpt_snapshot(trainer, metrics)
    background, in_step = tmp_path / "global_step_1", tmp_path / "in_step" / "global_step_1"
    trainer.save_checkpoint(str(background), {"step": 1}, background=True)
    # Training goes on while the files are written: the next step changes every tensor saved.
    trainer.train_step(build_batch(make_trajectories(seed=12), PAD))
    trainer.wait_for_checkpoint()
    assert is_complete(background) and trainer.checkpoint_writer.written_s > 0
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert not (background / "written").exists()  # the writers' markers are not the checkpoint's

    # Loaded, it is the state of step 1, as a checkpoint the step waited for would be.
    assert trainer.load_checkpoint(str(background)) == {"step": 1}
    restored = ckpt_snapshot(trainer, metrics)
    for part in ("actor", "critic", "actor_optim", "critic_optim", "actor_sched"):
        assert set(restored[part]) == set(taken[part]), part
        for key, want in taken[part].items():
            got = restored[part][key]
            assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, (part, key)
    trainer.save_checkpoint(str(in_step), {"step": 1})
    files = sorted(str(p.relative_to(in_step)) for p in in_step.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(background)) for p in background.rglob("*") if p.is_file()) == files
    assert os.path.getsize(background / "actor" / "state" / "mp_rank_00_model_states.pt") > 0
