"""``rlmesh ctl`` without a control plane: where it looks for the run (the run file ``rlmesh train``
writes, the user's list of running jobs, the config), what it prints for each command's answer, and
a refusal in words."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from rlmesh.config import load_config
from rlmesh.control.app import create_app
from rlmesh.control.ctl import build_parser, find_target, parse_assignments, refusal, show, split_overrides
from rlmesh.runtime.run_file import (
    RUN_FILE,
    RunFiles,
    RunInfo,
    is_live,
    read_run_file,
    running_jobs,
    this_process,
    user_runs_dir,
)
from tests.support.repo import CPU_DEMO


@pytest.fixture(autouse=True)
def own_runs_dir(tmp_path, monkeypatch):
    """A runs directory of the test's own, no URL in the environment, in an empty directory."""
    monkeypatch.setenv("RLMESH_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("RLMESH_CONTROL_URL", raising=False)
    monkeypatch.delenv("RLMESH_AUTH_TOKEN", raising=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")


def ended_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def published(tmp_path, name: str = "run-a", url: str = "http://127.0.0.1:41235") -> tuple[RunFiles, RunInfo]:
    files = RunFiles()
    info = this_process(name, url, tmp_path / name / "checkpoints", config=str(CPU_DEMO))
    files.write(info)
    return files, info


def notes() -> tuple[list[str], object]:
    said: list[str] = []
    return said, said.append


def test_the_run_file_is_private_and_goes_when_the_job_ends(tmp_path):
    with RunFiles() as files:
        info = this_process("run-a", "http://127.0.0.1:41235", tmp_path / "ckpt", auth=True)
        here, listed = files.write(info)
        assert here == tmp_path / "ckpt" / RUN_FILE and listed.parent == user_runs_dir()
        assert here.stat().st_mode & 0o777 == 0o600 and listed.stat().st_mode & 0o777 == 0o600
        assert user_runs_dir().stat().st_mode & 0o777 == 0o700
        read = read_run_file(here)
        assert read == info and read.pid == os.getpid() and is_live(read)
        assert "token" not in here.read_text()
        assert [j.run_id for j in running_jobs()] == ["run-a"]
    assert not here.exists() and not listed.exists()


def test_a_file_left_by_a_job_that_ended_is_not_a_running_job(tmp_path):
    _, info = published(tmp_path)
    ended = RunInfo(**{**vars(info), "pid": ended_pid(), "path": None})
    reused = RunInfo(**{**vars(info), "started": "1", "path": None})  # our pid, another start time
    assert not is_live(ended) and not is_live(reused)
    listed = user_runs_dir() / "ended.json"
    listed.write_text(json.dumps({**vars(ended), "run_id": "ended", "path": None}))
    assert [j.run_id for j in running_jobs()] == ["run-a"]
    assert not listed.exists()  # the entry of a killed job is cleaned up


def test_a_file_that_is_no_run_file_is_ignored(tmp_path):
    (tmp_path / RUN_FILE).write_text("{half")
    assert read_run_file(tmp_path / RUN_FILE) is None
    (tmp_path / RUN_FILE).write_text('{"url": 1}')
    assert read_run_file(tmp_path / RUN_FILE) is None
    assert read_run_file(tmp_path / "none.json") is None


def test_a_run_file_others_may_write_is_not_trusted(tmp_path):
    """ctl would send the token to the URL a run file names: one another user could have written
    (group- or world-writable) is no run."""
    files, _ = published(tmp_path)
    here = files.paths[0]
    assert read_run_file(here) is not None
    here.chmod(0o666)
    assert read_run_file(here) is None
    here.chmod(0o600)
    files.remove()


def test_overrides_before_the_command_are_the_configs():
    argv = ["-c", "job.yaml", "trainer.default_local_dir=/r", "--json", "set", "actor_lr=1e-6"]
    assert split_overrides(argv) == (
        ["-c", "job.yaml", "--json", "set", "actor_lr=1e-6"],
        ["trainer.default_local_dir=/r"],
    )
    assert split_overrides(["--url", "http://h:1", "status"]) == (["--url", "http://h:1", "status"], [])
    assert split_overrides(["status"]) == (["status"], [])


def test_where_ctl_looks_in_order(tmp_path, monkeypatch):
    said, note = notes()
    _, info = published(tmp_path)
    ckpt = info.checkpoint_dir
    given = ["-c", str(CPU_DEMO), f"trainer.default_local_dir={ckpt}"]

    def target(*argv: str):
        rest, overrides = split_overrides([*argv, "status"])
        args = build_parser().parse_args(rest)
        return find_target(args.url, args.config, overrides, args.run, note)

    # The only running job of the user's, from any directory.
    t = target()
    assert (t.url, t.source) == (info.url, f"the run file {user_runs_dir() / 'run-a.json'}")
    # -c CONFIG with the job's overrides: its checkpoint directory's run file.
    assert target(*given).source == f"the run file {ckpt}/{RUN_FILE}"
    # In the checkpoint directory: its run file.
    monkeypatch.chdir(ckpt)
    assert target().source == f"the run file {ckpt}/{RUN_FILE}"
    # Env RLMESH_CONTROL_URL before any run file, --url before that.
    monkeypatch.setenv("RLMESH_CONTROL_URL", "http://10.0.0.1:9/")
    assert (target().url, target().source) == ("http://10.0.0.1:9", "env RLMESH_CONTROL_URL")
    assert (target("--url", "http://10.0.0.2:9").source) == "--url"
    # No run file where -c points: the configured address, saying where it looked.
    monkeypatch.delenv("RLMESH_CONTROL_URL")
    t = target("-c", str(CPU_DEMO), f"trainer.default_local_dir={tmp_path / 'none'}")
    assert t.url == f"http://{load_config(str(CPU_DEMO), []).rlmesh.control.client_addresses()[0]}"
    assert t.source == f"rlmesh.control of {CPU_DEMO} with the overrides"
    assert str(tmp_path / "none" / RUN_FILE) in t.searched
    assert said == []


def test_two_running_jobs_are_named_and_a_stale_file_is_said(tmp_path, monkeypatch):
    said, note = notes()
    published(tmp_path, "run-a")
    published(tmp_path, "run-b", url="http://127.0.0.1:41236")
    with pytest.raises(SystemExit) as e:
        find_target(None, None, [], None, note)
    assert "2 jobs are running" in str(e.value) and "run-a" in str(e.value) and "run-b" in str(e.value)
    assert find_target(None, None, [], "run-b", note).url == "http://127.0.0.1:41236"
    # A run file in this directory that a killed job left: said, and the configured address used.
    stale = RunInfo(**{**vars(this_process("old", "http://x:1", tmp_path)), "pid": ended_pid(), "path": None})
    monkeypatch.chdir(tmp_path)
    (tmp_path / RUN_FILE).write_text(json.dumps({k: v for k, v in vars(stale).items() if k != "path"}))
    for run in ("run-a", "run-b"):
        (user_runs_dir() / f"{run}.json").unlink()
    t = find_target(None, None, [], None, note)
    assert t.source == "rlmesh.control's default address" and t.searched
    assert said == [
        f"ignoring {tmp_path / RUN_FILE}: its job (run old, pid {stale.pid}) is no longer running"
    ]


def answer(*argv: str, body: dict) -> str:
    return show(build_parser().parse_args(list(argv)), body)


STATUS = {
    "run_id": "r1",
    "step": 3,
    "total_steps": 10,
    "policy_version": 3,
    "phase": "paused",
    "paused": True,
    "live_replicas": 1,
    "last_checkpoint": "",
    "message": "",
    "eta_s": 12.0,
    "mean_step_s": 1.7,
    "hyperparams": {"actor_lr": 1e-6},
    "metrics": {"critic/score/mean": 0.5, "timing_start/step": 1.0},
}
ROWS = {
    "rows": [{"step": 1, "time": 0, "metrics": {"actor/lr": 1e-6}}, {"step": 2, "time": 0, "metrics": {}}]
}
ANSWERS = [
    (["status"], STATUS, ["run r1: step 3/10, policy v3, paused, ETA 12 s", "critic/score/mean = 0.5"]),
    (["metrics", "actor/lr"], ROWS, ["actor/lr", "   1  ", "1e-06"]),
    (["validation"], {"rows": []}, ["no validation yet"]),
    (
        ["config"],
        {"source": "learner", "config": {"trainer": {"total_training_steps": 5}}},
        ["  total_training_steps: 5"],
    ),
    (["pause"], {"step": 3, "phase": "training", "paused": True}, ["pausing", "(step 3)"]),
    (
        ["resume"],
        {"step": 3, "phase": "waiting_for_rollouts", "paused": False},
        ["resumed at step 3"],
    ),
    (
        ["stop", "--no-checkpoint"],
        {"step": 3, "phase": "stopping", "paused": False},
        ["without a checkpoint"],
    ),
    (["checkpoint"], {"path": "/c/global_step_3", "step": 3}, ["checkpoint of step 3: /c/global_step_3"]),
    (
        ["hparams"],
        {
            "values": {"actor_lr": 1e-6},
            "fields": {
                "actor_lr": {"key": "a.lr", "description": "lr", "min": 0, "min_exclusive": True, "max": 1}
            },
        },
        ["actor_lr", "1e-06", "(0, 1]", "a.lr"],
    ),
    (
        ["set", "actor_lr=5e-7"],
        {"applies_from_step": 4, "values": {"actor_lr": 5e-7, "kl_coef": 0.1}},
        ["from step 4 on:", "actor_lr = 5e-07"],
    ),
    (["replicas"], {"replicas": []}, ["no live replica"]),
    (
        ["replicas", "drain", "rollout-1"],
        {"replica_id": "rollout-1", "drained": True, "unfinished": 0, "message": ""},
        ["rollout-1: drained"],
    ),
    (
        ["replicas", "remove", "rollout-1"],
        {"replica_id": "rollout-1", "removed": True, "detail": "drained"},
        ["rollout-1: removed"],
    ),
    (
        ["rewards"],
        {
            "source": "redis",
            "rewards": [
                {"address": "h:1", "health": "SERVING", "functions": ["default"], "max_batch_size": 8}
            ],
        },
        ["the run's list in Redis", "h:1", "SERVING", "default"],
    ),
    (["rewards", "swap", "h:2"], {"addresses": ["h:2"]}, ["reward services now: h:2"]),
    (
        ["queues"],
        {
            "prompts": {"stream": "s", "length": 4, "pending": 1, "unread": 3},
            "dead_letters": {"stream": "d", "length": 0},
        },
        ["prompts", "pending       1", "dead letters"],
    ),
    (["dead-letters"], {"dead_letters": []}, ["no dead letters"]),
    (
        ["dead-letters", "replay", "1-0"],
        {"id": "1-0", "stream": "s", "new_entry_id": "2-0"},
        ["1-0 replayed onto s as 2-0"],
    ),
    (["audit"], {"entries": []}, ["no entries"]),
    (
        ["autoscale"],
        {
            "settings": {"enabled": True, "min_replicas": 1, "max_replicas": 8},
            "last": {
                "time": 1.0,
                "desired": 3,
                "wanted": 4,
                "live": 2,
                "reason": "2 tasks/s arriving; held at 3: up cool-down",
                "arrival_tasks_per_s": 2.0,
                "done_tasks_per_s": 1.5,
                "replica_tasks_per_s": 0.75,
                "tasks_outstanding": 6,
                "tasks_claimed": 4,
                "learner_backlog": 0,
                "capacity": 2,
            },
        },
        [
            "desired 3 replicas (between 1 and 8 replicas), 2 live; the load calls for 4",
            "held at 3",
            "0.75/s",
        ],
    ),
    (["autoscale", "--desired"], {"settings": {}, "last": {"desired": 5}}, ["5"]),
]


def test_status_shows_the_metrics_that_matter_and_how_to_see_the_rest():
    body = {
        **STATUS,
        "metrics": {"critic/score/mean": 0.5, "actor/grad_norm": 2.0, "x/y": 1, "timing_start/step": 1},
    }
    text = answer("status", body=body)
    assert text.endswith(
        "  critic/score/mean = 0.5\n  actor/grad_norm = 2\n  (1 more: rlmesh ctl metrics; every one: --json)"
    )


def test_a_paused_learner_is_said_paused_once_with_who_paused_it():
    message = "paused since start (rlmesh.learner.start_paused=true): `rlmesh ctl resume` starts training"
    text = answer("status", body={**STATUS, "message": message, "eta_s": None})
    assert text.splitlines()[0] == f"run r1: step 3/10, policy v3, {message}, ETA -"
    mid_step = {**STATUS, "phase": "training", "message": "step 4: 2/4 prompt groups collected"}
    assert answer("status", body=mid_step).splitlines()[0] == (
        "run r1: step 3/10, policy v3, training, pausing after this step "
        "(step 4: 2/4 prompt groups collected), ETA 12 s"
    )


def test_metrics_without_keys_show_the_last_step_and_with_keys_a_table():
    rows = [{"step": s, "time": 0, "metrics": {f"m/{i}": s * 1.0 for i in range(10)}} for s in (1, 2, 3)]
    text = answer("metrics", body={"rows": rows})
    assert text.startswith("3 steps logged, the last below;") and "step 3\n  m/0 = 3" in text
    assert "step 2" not in text
    assert "step 2\n" in answer("metrics", "--start", "2", body={"rows": rows[1:]})
    asked = [
        {**row, "metrics": {"m/0": row["step"], "m/1": row["step"]}} for row in rows
    ]  # as the API answers
    assert answer("metrics", "m/0", "m/1", body={"rows": asked}).splitlines()[1:] == [
        f"   {s}  {s:>10}  {s:>10}" for s in (1, 2, 3)
    ]


@pytest.mark.parametrize(("argv", "body", "expected"), ANSWERS, ids=[" ".join(a[0]) for a in ANSWERS])
def test_every_command_answers_in_lines(argv, body, expected):
    text = answer(*argv, body=body)
    assert not text.startswith("{"), text
    for part in expected:
        assert part in text, (part, text)


def test_every_command_has_a_readable_answer():
    commands = {a[0][0] for a in ANSWERS}
    parser_commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert commands == parser_commands


def test_json_after_the_command_too():
    assert build_parser().parse_args(["status", "--json"]).json
    assert build_parser().parse_args(["--json", "status"]).json
    assert not build_parser().parse_args(["status"]).json


def test_a_refused_value_is_a_plain_line_naming_the_field_and_its_range():
    # The plane's own 422 for it, from its app (the validation answers before any route runs).
    app = create_app(load_config(str(CPU_DEMO), []))
    client = TestClient(app, base_url="http://127.0.0.1")
    r = client.patch("/api/v1/hyperparams", json={"actor_lr": 5, "top_p": 0, "bogus": 1})
    assert r.status_code == 422 and isinstance(r.json()["detail"], list)
    lines = refusal("set", r.status_code, r.json())
    assert lines[0] == (
        "rlmesh ctl set: actor_lr: 5 is outside (0, 1], the range of the actor's peak lr "
        "(actor_rollout_ref.actor.optim.lr) (HTTP 422)"
    )
    assert lines[1].startswith("rlmesh ctl set: top_p: 0 is outside (0, 1]")
    assert lines[2].startswith("rlmesh ctl set: bogus: Extra inputs are not permitted")
    assert len(lines) == 3 and not any("{" in line for line in lines)
    assert refusal("checkpoint", 409, {"detail": "no step yet"}) == [
        "rlmesh ctl checkpoint: no step yet (HTTP 409)"
    ]
    assert "RLMESH_AUTH_TOKEN" in refusal("status", 401, {"message": "missing bearer token"})[0]


def test_a_config_whose_directory_holds_no_run_names_the_jobs_running(tmp_path):
    _, note = notes()
    published(tmp_path, "run-a")
    t = find_target(None, str(CPU_DEMO), [f"trainer.default_local_dir={tmp_path / 'elsewhere'}"], None, note)
    assert f"no run file at {tmp_path / 'elsewhere' / RUN_FILE}" in t.searched
    assert "running: run-a" in t.searched and "--run RUN_ID" in t.searched


def test_a_bad_assignment_says_what_is_wrong_with_it():
    with pytest.raises(SystemExit, match="unknown name 'lr': the live hyper-parameters are actor_lr"):
        parse_assignments(["lr=1e-5"])
    with pytest.raises(SystemExit, match="expected NAME=VALUE"):
        parse_assignments(["actor_lr"])
    with pytest.raises(SystemExit, match="'fast' is not a number"):
        parse_assignments(["actor_lr=fast"])
    assert parse_assignments(["actor_lr=1e-5", "kl_coef=0"]) == {"actor_lr": 1e-5, "kl_coef": 0.0}
