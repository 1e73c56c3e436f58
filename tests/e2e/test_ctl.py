"""``rlmesh ctl`` against a real ``rlmesh train`` job as a user types it, no URL given: with the
job's ``-c CONFIG`` and overrides, from its checkpoint directory, and as docs/operations.md shows it from
anywhere; a refused value in words; resumed, the job finishes, and then ctl says no job runs."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rlmesh.runtime.run_file import RUN_FILE
from tests.support.jobs import Job, make_files, overrides
from tests.support.polling import wait_until
from tests.support.processes import child_env
from tests.support.repo import CPU_DEMO, REPO

STEPS = 2


def ctl(*args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", "ctl", *args],
        cwd=cwd,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(900)
def test_ctl_finds_a_running_job_without_being_told_where(tmp_path, monkeypatch):
    runs = tmp_path / "runs"  # the user's list of running jobs, of this test's own
    monkeypatch.setenv("RLMESH_RUNS_DIR", str(runs))
    for name in ("RLMESH_CONTROL_URL", "RLMESH_AUTH_TOKEN"):  # a first afternoon: neither set
        monkeypatch.delenv(name, raising=False)
    files = make_files(tmp_path / "files")
    run_dir = tmp_path / "run"
    run_id = f"ctl-e2e-{uuid.uuid4().hex[:6]}"
    given = [
        *overrides(files, run_dir, STEPS),
        f"rlmesh.run_id={run_id}",
        "rlmesh.rollout.replicas=1",
        "rlmesh.learner.start_paused=true",  # it holds until ctl resumes it
    ]
    job = Job.start(["-c", str(CPU_DEMO), *given])
    try:
        path = job.wait_for(r"rlmesh ctl status reaches it \(run file (\S+)\)", 600)[1]
        assert Path(path) == run_dir / RUN_FILE and (run_dir / RUN_FILE).stat().st_mode & 0o777 == 0o600
        nowhere = str(tmp_path / "no-runs")  # no list: only the config or the directory can tell
        out = ctl("-c", str(CPU_DEMO), *given, "status", RLMESH_RUNS_DIR=nowhere)
        assert out.returncode == 0 and out.stdout.startswith(f"run {run_id}: step 0/{STEPS}"), out.stderr
        out = ctl("status", cwd=run_dir, RLMESH_RUNS_DIR=nowhere)
        assert out.returncode == 0 and out.stdout.startswith(f"run {run_id}: "), out.stderr
        out = ctl("status")  # the line README.md shows, from the repository's root
        assert out.returncode == 0 and out.stdout.startswith(f"run {run_id}: "), out.stderr
        # Held by its start_paused, and said so, once: by the job and by ctl.
        job.wait_for(r"^\[train\] learner: paused since start \(rlmesh\.learner\.start_paused=true\)", 120)
        held = "paused since start (rlmesh.learner.start_paused=true)"
        wait_until(lambda: held in ctl("status").stdout, 120, "ctl status to say the learner is held")
        out = ctl("status")
        assert "paused (paused" not in out.stdout and "no rollout replica" not in out.stdout, out.stdout

        out = ctl("set", "actor_lr=5")
        assert out.returncode == 1 and out.stderr.startswith("rlmesh ctl set: actor_lr: 5 is outside (0, 1]")
        assert len(out.stderr.splitlines()) == 1, out.stderr

        out = ctl("resume")
        assert out.returncode == 0 and out.stdout.startswith("resumed"), out.stderr
        assert job.finish(600) == 0, job.tail()
    finally:
        if job.proc.poll() is None:  # a failed check: Ctrl-C stops what the job started
            job.proc.send_signal(signal.SIGINT)
            job.proc.wait(timeout=120)
    assert not (run_dir / RUN_FILE).exists() and not list(runs.glob("*.json"))
    out = ctl("status", cwd=run_dir)
    assert out.returncode == 1 and out.stderr.startswith("rlmesh ctl: no running job found"), out.stderr
