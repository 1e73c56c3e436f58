"""``rlmesh ctl`` as a user types it against a real control plane and learner (processes, private
Redis) whose run file is written as ``rlmesh train`` writes it: found with ``-c CONFIG`` and the
job's overrides, from the run's directory, and from anywhere as the only job running; every command
answered in lines; a refused value in words; no job once its run file is gone; over TLS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlmesh.control.ctl import main as ctl_main
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.run_file import RUN_FILE, RunFiles, this_process
from rlmesh.runtime.tls import TlsFiles, export_tls
from tests.support.control import TOKEN, start_control_stack
from tests.support.polling import wait_until
from tests.support.processes import child_env
from tests.support.repo import CPU_DEMO, REPO
from tests.support.tls import make_tls_files


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The stack and its run file, written as ``rlmesh train`` writes it (this process stands for
    the train process), into a runs directory of this module's own (RLMESH_RUNS_DIR)."""
    root = tmp_path_factory.mktemp("ctl")
    with (
        ProcessLauncher(root / "procs", stop_grace_s=10) as launcher,
        pytest.MonkeyPatch.context() as mp,
        RunFiles() as files,
    ):
        mp.setenv("RLMESH_RUNS_DIR", str(root / "runs"))
        stack = start_control_stack(launcher, root)
        info = this_process(stack.run_id, stack.url, root / "run", config=str(CPU_DEMO), auth=True)
        files.write(info)
        yield info


def ctl(*args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", "ctl", *args],
        cwd=cwd,
        env=child_env(**{"RLMESH_AUTH_TOKEN": TOKEN, **env}),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ctl_finds_the_run_from_its_config_its_directory_and_anywhere(job, tmp_path):
    nowhere = str(tmp_path / "no-runs")  # a runs directory that lists no job
    ckpt = job.checkpoint_dir
    out = ctl("-c", str(CPU_DEMO), f"trainer.default_local_dir={ckpt}", "status", RLMESH_RUNS_DIR=nowhere)
    assert out.returncode == 0 and out.stdout.startswith(f"run {job.run_id}: step 0/"), out.stderr
    out = ctl("status", cwd=Path(ckpt), RLMESH_RUNS_DIR=nowhere)
    assert out.returncode == 0 and out.stdout.startswith(f"run {job.run_id}: "), out.stderr
    out = ctl("status")  # the line README.md shows: the only job running
    assert out.returncode == 0 and out.stdout.startswith(f"run {job.run_id}: "), out.stderr


def test_without_the_token_ctl_says_where_it_goes(job):
    out = ctl("status", RLMESH_AUTH_TOKEN="")
    assert out.returncode == 1 and out.stdout == ""
    assert "wants the run's token (HTTP 401)" in out.stderr and "RLMESH_AUTH_TOKEN" in out.stderr, out.stderr


def test_a_refused_value_is_one_plain_line(job):
    out = ctl("set", "actor_lr=5")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (
        "rlmesh ctl set: actor_lr: 5 is outside (0, 1], the range of the actor's peak lr "
        "(actor_rollout_ref.actor.optim.lr) (HTTP 422)\n"
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["hparams"], "actor_rollout_ref.actor.optim.lr"),
        (["metrics", "actor/lr"], "no metrics logged yet"),
        (["validation"], "no validation yet"),
        (["config"], "total_training_steps:"),
        (["replicas"], "no live replica"),
        (["rewards"], "127.0.0.1:1"),
        (["queues"], "prompts"),
        (["dead-letters"], "no dead letters"),
        (["audit"], ""),
        (["pause"], "pausing"),
        (["resume"], "resumed"),
    ],
)
def test_every_command_answers_in_lines(job, argv, expected, capsys, monkeypatch):
    monkeypatch.setenv("RLMESH_AUTH_TOKEN", TOKEN)
    assert ctl_main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert expected in out and not out.startswith(("{", "[")), out
    assert ctl_main(["--json", *argv]) == 0
    json.loads(capsys.readouterr().out)


def test_a_change_is_said_and_audited(job, capsys, monkeypatch):
    monkeypatch.setenv("RLMESH_AUTH_TOKEN", TOKEN)
    assert ctl_main(["set", "entropy_coeff=0.002"]) == 0
    assert capsys.readouterr().out.endswith("on:\n  entropy_coeff = 0.002\n")
    assert ctl_main(["audit", "--limit", "1"]) == 0
    assert "set_hyperparam entropy_coeff: 0.0 -> 0.002" in capsys.readouterr().out


def test_a_paused_learner_says_who_paused_it_once(job, capsys, monkeypatch):
    monkeypatch.setenv("RLMESH_AUTH_TOKEN", TOKEN)

    def status() -> str:
        assert ctl_main(["status"]) == 0
        return capsys.readouterr().out.splitlines()[0]

    assert ctl_main(["pause"]) == 0  # the learner waits for replicas (none come): it holds at once
    wait_until(lambda: "paused from the control plane (rlmesh ctl pause)" in status(), 60, "the pause")
    assert "paused (paused" not in status() and "replica" not in status()
    assert ctl_main(["resume"]) == 0
    wait_until(lambda: "(no rollout replica registered yet)" in status(), 60, "the wait for replicas")


def test_a_refused_action_says_why(job, capsys, monkeypatch):
    monkeypatch.setenv("RLMESH_AUTH_TOKEN", TOKEN)
    assert ctl_main(["checkpoint"]) == 1  # no step yet to checkpoint
    err = capsys.readouterr().err
    assert err.startswith("rlmesh ctl checkpoint: ") and "(HTTP 409)" in err and "{" not in err, err


def test_once_the_job_is_gone_ctl_says_no_job_runs(job, tmp_path):
    # A second job of the same plane that ended: its files removed as the job ends.
    with RunFiles() as files:
        files.write(this_process("gone", job.url, tmp_path / "run"))
    nowhere = str(tmp_path / "no-runs")
    out = ctl("status", cwd=tmp_path / "run", RLMESH_RUNS_DIR=nowhere)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(
        f"rlmesh ctl: no running job found (no run file at {tmp_path}/run/{RUN_FILE}"
    )
    assert "nothing answers at http://127.0.0.1:8000 (rlmesh.control's default address)" in out.stderr
    # A run file a killed job left behind: said and skipped.
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stale = {**vars(this_process("killed", job.url, tmp_path / "run")), "pid": ended.pid}
    (tmp_path / "run" / RUN_FILE).write_text(json.dumps({k: v for k, v in stale.items() if k != "path"}))
    out = ctl("status", cwd=tmp_path / "run", RLMESH_RUNS_DIR=nowhere)
    assert out.returncode == 1
    assert (
        f"rlmesh ctl: ignoring {tmp_path}/run/{RUN_FILE}: its job (run killed, pid {ended.pid}) is no longer running"
        in out.stderr
    )
    assert "no running job found" in out.stderr


def test_a_run_over_tls_is_reached_with_the_files_its_run_file_names(tmp_path, monkeypatch):
    """A bare ``rlmesh ctl`` whose shell has no TLS settings: the run file names the job's files."""
    made = make_tls_files(tmp_path / "tls")
    tls = TlsFiles(str(made.cert_file), str(made.key_file), str(made.ca_file))
    env: dict[str, str] = {}
    export_tls(tls, env)
    for name, value in env.items():  # the stack's processes speak TLS, as a job's would
        monkeypatch.setenv(name, value)
    with ProcessLauncher(tmp_path / "procs", stop_grace_s=10) as launcher, RunFiles() as files:
        stack = start_control_stack(launcher, tmp_path / "stack")
        url = f"https://{stack.control.grpc_address}"
        files.write(this_process(stack.run_id, url, tmp_path / "run", auth=True, tls=tls))
        for name in env:
            monkeypatch.delenv(name)
        out = ctl("status", cwd=tmp_path / "run", RLMESH_RUNS_DIR=str(tmp_path / "no-runs"))
    assert out.returncode == 0 and out.stdout.startswith(f"run {stack.run_id}: "), out.stderr
