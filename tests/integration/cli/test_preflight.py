"""``rlmesh config validate`` and ``rlmesh train`` as a user runs them on a job with mistakes: every
problem on stderr and exit 2, before anything starts; a finished run said in one line, exit 0."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from rlmesh.cli import cmd_config
from tests.support.preflight import make_job, write_checkpoint
from tests.support.processes import child_env
from tests.support.repo import REPO


def rlmesh(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", *map(str, args)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def processes_naming(text: str) -> list[str]:
    """The command lines of this machine's processes that mention ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if text in args:
            found.append(args)
    return found


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return make_job(tmp_path_factory.mktemp("cli-preflight"))


def test_validate_a_valid_job_says_what_it_checked(job):
    out = rlmesh("config", "validate", "-c", job.config)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("configuration is valid\n")
    assert "  data.train_files: 12 prompts" in out.stdout and "  data.val_files: 4 prompts" in out.stdout
    assert f"  reward: {job.reward}:compute_score; called on 2 rows" in out.stdout
    assert "checking: reading data.train_files" in out.stderr  # progress, on stderr
    assert not job.run_dir.exists()


def test_validate_lists_every_problem_and_exits_2(job, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n  return (\n"
    )
    out = rlmesh(
        "config",
        "validate",
        "-c",
        job.config,
        f"data.val_files={tmp_path / 'val.parquet'}",
        f"custom_reward_function.path={broken}",
        "data.max_prompt_length=20",
    )
    assert out.returncode == 2, out.stdout
    assert "invalid configuration: 3 problems:\n" in out.stderr
    problems = [line for line in out.stderr.splitlines() if line.startswith("  - ")]
    assert problems[0].startswith(
        f"  - data.train_files: {job.train}, column 'prompt': 12 of 12 prompts are longer"
    )
    assert "data.max_prompt_length=20" in problems[0] and "data.filter_overlong_prompts=true" in problems[0]
    assert problems[1] == f"  - data.val_files: {tmp_path / 'val.parquet'}: no such file"
    assert "raised SyntaxError" in problems[2] and f"at {broken}:2" in problems[2]
    assert "configuration is valid" not in out.stdout
    # --schema-only: the keys and values only, for a machine without the files.
    out = rlmesh(
        "config", "validate", "-c", job.config, "--schema-only", f"data.val_files={tmp_path / 'val.parquet'}"
    )
    assert out.returncode == 0 and out.stdout.startswith("configuration is valid (--schema-only")


def test_train_with_a_mistake_starts_nothing_and_exits_2(job, tmp_path):
    run_dir = tmp_path / "run"
    out = rlmesh(
        "train",
        "-c",
        job.config,
        f"trainer.default_local_dir={run_dir}",
        f"actor_rollout_ref.model.path={tmp_path}/m",
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert (
        "rlmesh train: the pre-flight checks found what would fail the job; nothing was started:"
        in out.stderr
    )
    assert f"  - actor_rollout_ref.model.path={tmp_path}/m: no such directory" in out.stderr
    assert not run_dir.exists()
    assert "[train] run " not in out.stdout  # the line run_job says first


def test_train_on_a_finished_run_says_so_and_starts_nothing(job, capsys):
    checkpoint = write_checkpoint(job, 3)
    out = rlmesh("train", "-c", job.config)
    assert out.returncode == 0, out.stdout + out.stderr
    line = (
        f"rlmesh train: nothing to train: the checkpoint {checkpoint} is at step 3 and this run has 3 steps"
    )
    assert line in out.stdout
    assert not (job.run_dir / "services").exists() and "[train] run " not in out.stdout
    assert processes_naming(str(job.root)) == []  # no service left behind (nor started)
    # `rlmesh config validate` says it as a note (its command, in this process: no second start-up).
    args = argparse.Namespace(action="validate", config=str(job.config), schema_only=False)
    assert cmd_config(args, []) == 0
    assert f"note: nothing to train: the checkpoint {checkpoint} is at step 3" in capsys.readouterr().out
