"""A job's end, as ``run_job`` runs it: the learner writes the actor from memory once its last step
is done, then the services stop side by side; the export is the same as ``rlmesh export`` of the
last step's checkpoint, and nothing the job started outlives it."""

from __future__ import annotations

import json

from rlmesh.job.train import ACTOR_DIR, run_job
from rlmesh.learner.checkpoints.export import export_checkpoint
from tests.support.jobs import make_files, overrides
from tests.support.processes import pid_alive
from tests.support.repo import CPU_DEMO

STEPS = 2


def test_the_learner_exports_the_actor_and_the_services_stop(tmp_path):
    files = make_files(tmp_path / "files")
    run_dir = tmp_path / "run"
    started = {}

    def after_start(stack):
        started.update(stack.processes())

    result = run_job(
        str(CPU_DEMO),
        [
            *overrides(files, run_dir, STEPS),
            "trainer.save_freq=1",
            "rlmesh.rollout.replicas=1",
            "rlmesh.control.enabled=false",
        ],
        say=lambda line: None,
        after_start=after_start,
        export=True,
    )
    assert result.code == 0, result.failure
    assert set(started) == {"redis", "reward", "rollout-0", "learner"}
    assert not [name for name, proc in started.items() if pid_alive(proc.pid)]
    # Written by the learner (no process of its own), as `rlmesh export` writes it from the last
    # step's checkpoint.
    assert not (result.service_dir / "logs" / "export.log").exists()
    learner_log = (result.service_dir / "logs" / "learner.log").read_text()
    assert f"exported the actor to {run_dir / ACTOR_DIR}" in learner_log
    assert not list(run_dir.glob(f"{ACTOR_DIR}.*")), "a temporary directory was left"
    assert result.exported == run_dir / ACTOR_DIR and result.outputs_written
    state = json.loads((run_dir / f"global_step_{STEPS}" / "trainer_state.json").read_text())
    assert state["extra_state"]["step"] == STEPS
    again = export_checkpoint(run_dir / f"global_step_{STEPS}", tmp_path / "again")
    for name in ("config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (result.exported / name).read_bytes(), name
    assert (run_dir / "training.png").exists()
