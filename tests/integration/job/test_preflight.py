"""The pre-flight recognises a finished run from the checkpoint the learner wrote, counting the run's
steps as the learner does, and refuses a checkpoint to resume that the learner could not load."""

from __future__ import annotations

import pytest

from rlmesh.config import load_config
from rlmesh.job.preflight import run_preflight
from tests.support.preflight import TRAIN_ROWS, make_job, write_checkpoint

STEPS = 3  # the job's trainer.total_training_steps


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    job = make_job(tmp_path_factory.mktemp("finished"))
    return job, write_checkpoint(job, STEPS)


def preflight(job, *overrides: str):
    return run_preflight(load_config(job.config, list(overrides), warn=False))


def test_a_run_at_its_last_step_is_finished(finished):
    job, checkpoint = finished
    report = preflight(job)
    assert report.problems == [] and report.finished is not None
    # Its length is given (trainer.total_training_steps): told before the model or data are loaded.
    assert [c for c in report.checked if not c.startswith("resume:")] == [], report.checked
    assert (report.finished.checkpoint, report.finished.step, report.finished.total_steps) == (
        str(checkpoint),
        3,
        3,
    )
    line = report.finished.line()
    assert line.startswith(
        f"nothing to train: the checkpoint {checkpoint} is at step 3 and this run has 3 steps "
    )
    assert "(trainer.total_training_steps=3)" in line
    for change in (
        "raise trainer.total_training_steps",
        "trainer.default_local_dir",
        "trainer.resume_mode=disable",
    ):
        assert change in line
    # Past its last step too (a shorter run asked for now).
    assert preflight(job, "trainer.total_training_steps=2").finished.total_steps == 2


def test_more_steps_resume_and_are_not_finished(finished):
    job, checkpoint = finished
    report = preflight(job, "trainer.total_training_steps=5")
    assert report.problems == [] and report.finished is None
    assert f"resume: from {checkpoint} at step 3 of 5" in report.checked


def test_steps_from_epochs_count_as_the_learners(finished):
    job, _ = finished
    # total_epochs x (rows // train_batch_size), as the learner's total_training_steps: 1 x 12 // 4 = 3.
    report = preflight(job, "trainer.total_training_steps=null", "trainer.total_epochs=1")
    assert report.finished is not None and report.finished.total_steps == TRAIN_ROWS // 4 == 3
    line = report.finished.line()
    assert f"trainer.total_epochs=1 x {TRAIN_ROWS} prompts / data.train_batch_size=4" in line
    assert "To train more, raise trainer.total_epochs (or set trainer.total_training_steps)" in line
    assert preflight(job, "trainer.total_training_steps=null", "trainer.total_epochs=2").finished is None


def test_no_resume_or_val_only_is_never_finished(finished):
    job, _ = finished
    assert preflight(job, "trainer.resume_mode=disable").finished is None
    # val_only validates the resumed policy: the run has something to do.
    assert preflight(job, "trainer.val_only=true").finished is None


def test_resume_path(finished, tmp_path):
    job, checkpoint = finished
    other = f"trainer.default_local_dir={tmp_path / 'elsewhere'}"
    report = preflight(
        job, other, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={checkpoint}"
    )
    assert report.finished is not None and report.finished.checkpoint == str(checkpoint)
    assert report.finished.line().endswith("; to start over, set trainer.resume_mode=disable")
    half = tmp_path / "global_step_9"
    half.mkdir()  # no COMPLETE marker: a save that died half-way
    report = preflight(job, other, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={half}")
    assert report.problems == [
        f"trainer.resume_from_path={half}: not a complete checkpoint (no such directory, or no COMPLETE marker "
        "in it); the learner cannot resume from it"
    ]
