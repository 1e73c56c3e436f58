"""What ``rlmesh train`` says and decides on its own: how often it restarts one crashed service,
its step lines and the remaining time, what the learner is doing, where a stopped job resumes."""

import json

from rlmesh.job.train import (
    JobResult,
    PausedTime,
    RestartBudget,
    checkpoint_line,
    learner_failure,
    learner_state,
    progress_line,
    reward_failures,
    summarize,
)


def test_each_service_gets_its_own_budget_per_hour():
    now = [1000.0]
    budget = RestartBudget(2, clock=lambda: now[0])
    assert [budget.take("rollout-0"), budget.take("rollout-0"), budget.take("rollout-0")] == [1, 2, 0]
    assert budget.take("reward") == 1  # another service: its own count
    now[0] += 3599
    assert budget.take("rollout-0") == 0  # both restarts are still within the hour
    now[0] += 2
    assert budget.take("rollout-0") == 1  # they are not any more


def test_a_zero_budget_never_restarts():
    assert RestartBudget(0).take("redis") == 0


def test_the_eta_leaves_out_the_time_the_learner_was_paused():
    row = {"timing_s/step": 2.0, "training/tokens": 100}
    # 4 steps of 10 done in 100 s, 60 of them paused: 10 s a step while it works.
    line = progress_line(4, 10, row, elapsed_s=100, paused_s=60)
    assert "[100 s, 60 s paused, eta 60 s]" in line
    assert "[100 s, eta 150 s]" in progress_line(4, 10, row, elapsed_s=100)  # never paused


def test_paused_time_counts_from_the_first_poll_that_saw_the_pause_to_the_first_that_did_not():
    now = [0.0]
    paused = PausedTime(clock=lambda: now[0])
    for t, seen in [(1, False), (3, True), (5, True), (8, False), (9, False), (10, True)]:
        now[0] = t
        paused.seen(seen)
    now[0] = 12
    assert paused.seconds == (8 - 3) + (12 - 10)  # one pause over, one under way


def test_the_learner_state_says_a_paused_phase_once():
    message = "paused since start (rlmesh.learner.start_paused=true): `rlmesh ctl resume` starts training"
    assert learner_state("paused", message) == message
    assert learner_state("training", "step 3: 2/4 prompt groups collected") == (
        "training - step 3: 2/4 prompt groups collected"
    )
    assert learner_state("starting", "") == "starting"


def make_checkpoint(root, step, state=None):
    path = root / f"global_step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps(state or {"extra_state": {"step": step}}))
    (path / "COMPLETE").write_text("")
    return path


def test_after_ctrl_c_the_job_names_the_checkpoint_the_same_command_resumes_from(tmp_path):
    assert checkpoint_line(tmp_path) == (
        f"no checkpoint in {tmp_path}: running the same command again starts over"
    )
    make_checkpoint(tmp_path, 4)
    newest = make_checkpoint(tmp_path, 6)
    (tmp_path / "global_step_8.tmp-123").mkdir()  # a save cut short: not a checkpoint
    assert checkpoint_line(tmp_path) == (
        f"last checkpoint: step 6 ({newest}); running the same command again resumes from it"
    )


TEXT_LOG = """\
2026-12-03 15:00:51,830 WARNING [learner/r] rlmesh.learner: validation before training: the reward failed
2026-12-03 15:00:51,859 ERROR [learner/r] rlmesh.learner: training failed
Traceback (most recent call last):
  File "/x/loop.py", line 10, in run
    raise RewardFailed(message)
rlmesh.reward.failures.RewardFailed: validation before training: the reward failed on 34 of 50 samples
  File "bad/reward.py", line 4, in compute_score
Fix the reward function and run the same command again.
2026-12-03 15:00:52,001 INFO [learner/r] rlmesh.runtime: stopped
"""


def test_the_learners_failure_is_read_from_a_text_log_as_from_a_json_one(tmp_path):
    text = tmp_path / "text.log"
    text.write_text(TEXT_LOG)
    why = learner_failure(text)
    assert why is not None and why.startswith(
        "rlmesh.reward.failures.RewardFailed: validation before training"
    )
    assert why.endswith("run the same command again.")  # the record's last line, not the next record
    record = {
        "msg": "training failed",
        "exc": TEXT_LOG.split("training failed\n", 1)[1].rsplit("\n2026", 1)[0],
    }
    json_log = tmp_path / "json.log"
    json_log.write_text(json.dumps({"msg": "serving"}) + "\n" + json.dumps(record) + "\n")
    assert learner_failure(json_log) == why
    quiet = tmp_path / "quiet.log"
    quiet.write_text("2026-12-03 15:00:51,830 INFO [learner/r] rlmesh.learner: stopped\n")
    assert learner_failure(quiet) is None


def test_the_summary_counts_the_failed_rewards_of_the_training_steps():
    rows = [
        {"step": 0, "val/score": 0.5, "val/reward/failed": 3.0, "val/reward/failed_ratio": 0.3},
        {"step": 1, "timing_s/step": 1.0, "reward/failed": 4.0, "reward/failed_ratio": 0.25},
        {"step": 2, "timing_s/step": 1.0, "reward/failed": 0.0, "reward/failed_ratio": 0.0},
        {"step": 3, "timing_s/step": 1.0, "reward/failed": 8.0, "reward/failed_ratio": 0.5},
    ]
    assert reward_failures(rows) == (12, 32)  # 4 of 16 and 8 of 16; validation's are its own
    assert reward_failures(rows[2:3]) is None


def test_a_resumed_runs_summary_says_which_steps_this_run_trained(tmp_path, capsys):
    rows = [
        {"step": s, "time": 100.0 + s, "timing_s/step": 1.0, "training/tokens": 10.0} for s in range(1, 21)
    ]
    result = JobResult(
        code=0, run_id="r", checkpoint_dir=tmp_path, service_dir=tmp_path, wall_s=7, started_wall=113.5
    )
    result.rows, result.outputs_written = rows, True
    summarize(result, "title", export=False)
    assert "PPO steps                         20   (14-20 this run, resumed)" in capsys.readouterr().out
    result.started_wall = 0.0  # every row is this run's: not resumed
    summarize(result, "title", export=False)
    assert "this run" not in capsys.readouterr().out
