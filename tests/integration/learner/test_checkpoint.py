"""Checkpoint, SIGKILL, resume: the resumed run's next step equals the uninterrupted run's.

The first learner process trains a step, checkpoints, trains another step and is SIGKILLed while
writing its second checkpoint (every rank's files written, COMPLETE not yet). A second process
resumes from the latest complete checkpoint and trains step 2; this test process runs steps 1 and
2 without interruption. Weights, optimizer states (ZeRO-2 partitions for the actor), the lr
schedule, the KL controller and the step-2 metrics must be equal (exactly: same code, same
single-threaded kernels), and the RNG must continue where the checkpoint left it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch

from rlmesh.learner import build_batch
from tests.support.learner import PAD, ckpt_snapshot, ckpt_trainer, make_trajectories
from tests.support.polling import wait_until
from tests.support.processes import child_env, program
from tests.support.repo import REPO


def _assert_same(got, want, what):
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), what
    else:
        assert got == want, what


@pytest.mark.slow
def test_checkpoint_sigkill_resume_equals_uninterrupted_run(tiny_model_dir, tmp_path):
    root = tmp_path / "ckpts"
    first_out, resume_out = tmp_path / "first.json", tmp_path / "resume.pt"
    log = open(tmp_path / "first.log", "w+")  # noqa: SIM115 - read back while the process runs
    first = subprocess.Popen(
        program("checkpoint_learner", "first", "--model", tiny_model_dir, "--root", root, "--out", first_out),
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=child_env(DS_ACCELERATOR="cpu"),
    )  # fmt: skip
    try:
        wait_until(lambda: "HALF" in (tmp_path / "first.log").read_text() or first.poll() is not None, 120,
                   "the first learner to be half-way through its second checkpoint")  # fmt: skip
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
        log.close()
    assert first.returncode == -signal.SIGKILL
    half = [p.name for p in root.iterdir() if ".tmp-" in p.name]
    assert half and (root / half[0] / "actor").is_dir(), sorted(p.name for p in root.iterdir())

    resume = subprocess.run(
        program("checkpoint_learner", "resume", "--model", tiny_model_dir, "--root", root,
                "--out", resume_out),
        cwd=REPO, capture_output=True, text=True, env=child_env(DS_ACCELERATOR="cpu"), timeout=120,
    )  # fmt: skip
    assert resume.returncode == 0, resume.stdout[-3000:] + resume.stderr[-5000:]
    got = torch.load(resume_out, weights_only=False)
    assert got["path"] == str(root / "global_step_1")
    assert got["extra"] == {"step": 1, "policy_version": 1, "cursor": 8, "used_uids": ["p0/0", "p0/1"]}
    assert got["rand"] == json.loads(first_out.read_text())["rand"]

    trainer = ckpt_trainer(tiny_model_dir)
    trainer.train_step(build_batch(make_trajectories(seed=11), PAD))
    metrics = trainer.train_step(build_batch(make_trajectories(seed=12), PAD))
    want = ckpt_snapshot(trainer, metrics)
    assert want["metrics"]["actor/lr"] > 0 and want["kl_ctrl"]["value"] != 0.001
    for part, expected in want.items():
        if isinstance(expected, dict):
            assert set(got[part]) == set(expected), part
            for key, value in expected.items():
                _assert_same(got[part][key], value, f"{part} {key}")
        else:
            _assert_same(got[part], expected, part)
