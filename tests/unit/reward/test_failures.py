"""A failed reward: the error names the user's file and line with the last frames of the traceback;
the rule that scores the sample (penalty or drop), counts it, and stops the run past the threshold."""

import asyncio

import pytest

from rlmesh.config import load_config
from rlmesh.reward.failures import (
    FailureTally,
    RewardErrorRule,
    RewardFailed,
    is_reward_failure,
    step_line_part,
)
from rlmesh.reward.function_loader import load_reward_function
from rlmesh.reward.scorer import RewardScorer
from rlmesh.v1 import common_pb2, reward_pb2, trajectory_pb2

USER_REWARD = """\
import json


def parse(text):
    return json.loads(text)  # PARSE


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "json":
        return parse("{not json")["score"]  # CALLS PARSE
    if solution_str == "type":
        return solution_str + 1  # TYPE
    if solution_str == "exit":
        raise SystemExit(3)  # EXIT
    return float(solution_str == ground_truth)


async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio_sleep0()
    return 1 / 0  # ASYNC


async def asyncio_sleep0():
    import asyncio

    await asyncio.sleep(0)
"""


def line_of(marker: str) -> int:
    return next(i for i, line in enumerate(USER_REWARD.splitlines(), 1) if line.endswith(f"# {marker}"))


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return path


def score(function, *responses):
    async def run():
        scorer = RewardScorer(function, timeout_s=5)
        try:
            return await scorer.score(
                [
                    reward_pb2.RewardSample(uid=r, response_text=r, ground_truth="1", data_source="mine")
                    for r in responses
                ]
            )
        finally:
            scorer.close()

    return asyncio.run(run())


def test_a_raise_names_the_users_file_and_line_and_shows_the_last_frames(user_file):
    results = {r.uid: r for r in score(load_reward_function(str(user_file)), "type", "json", "exit", "1")}
    assert not results["1"].HasField("error") and results["1"].score == 1.0

    err = results["type"].error
    assert (
        err.code == common_pb2.ERROR_CODE_FUNCTION_FAILED
        and err.source == f"reward:{user_file}:compute_score"
    )
    headline, *frames = err.message.splitlines()
    assert headline.startswith("sample uid='type' data_source='mine': reward function ")
    assert 'raised TypeError: can only concatenate str (not "int") to str' in headline
    assert headline.endswith(f", at {user_file}:{line_of('TYPE')}")
    assert frames == [
        f'  File "{user_file}", line {line_of("TYPE")}, in compute_score',
        "    return solution_str + 1  # TYPE",
    ]

    # Raised in a library the user's code called: the site is the user's deepest line (in a helper
    # of theirs), and the frames keep the entry, that line and the deepest one.
    err = results["json"].error
    assert err.message.splitlines()[0].endswith(f", at {user_file}:{line_of('PARSE')}")
    assert "JSONDecodeError" in err.message
    files = [line.split('"')[1] for line in err.message.splitlines() if line.startswith('  File "')]
    assert len(files) == 3 and files[:2] == [str(user_file), str(user_file)]
    assert "frame(s) left out" in err.message
    # Never the scorer's machinery: the thread pool, the guard, the loader's call.
    for machinery in (
        "rlmesh/reward/pool.py",
        "rlmesh/reward/function_loader.py",
        "concurrent/futures",
        "threading.py",
    ):
        assert machinery not in err.message

    assert (
        results["exit"]
        .error.message.splitlines()[0]
        .endswith(f"SystemExit: 3, at {user_file}:{line_of('EXIT')}")
    )


def test_an_async_reward_is_traced_to_its_line_too(user_file):
    (result,) = score(load_reward_function(str(user_file), "async_score"), "x")
    assert "ZeroDivisionError: division by zero" in result.error.message
    assert f'File "{user_file}", line {line_of("ASYNC")}, in async_score' in result.error.message
    assert "asyncio" not in result.error.message.replace("asyncio_sleep0", "")


def failed(uid="g/0", message="sample uid='g/0': reward function f raised KeyError: 'x'", source="reward:f"):
    return trajectory_pb2.Trajectory(
        uid=uid,
        group_uid="g",
        prompt_ids=[1],
        response_ids=[2],
        score=0.0,
        error=common_pb2.SampleError(
            code=common_pb2.ERROR_CODE_FUNCTION_FAILED, message=message, source=source
        ),
    )


def test_penalty_scores_a_failed_reward_and_clears_its_error_drop_leaves_it():
    traj = failed()
    penalised = RewardErrorRule(error_score=-1.0).apply(traj)
    assert penalised.score == -1.0 and not penalised.HasField("error")
    assert not penalised.HasField("baseline_score")  # the run needs none
    assert traj.HasField("error") and traj.score == 0.0  # the received trajectory is left as it was
    assert RewardErrorRule(on_error="drop").apply(traj) is traj
    # A reference or replica failure is no reward's: the rule leaves it to the learner's checks.
    other = failed(source="reference")
    assert not is_reward_failure(other.error) and RewardErrorRule().apply(other) is other
    ok = trajectory_pb2.Trajectory(uid="g/1", score=1.0)
    assert not is_reward_failure(ok.error) and RewardErrorRule().apply(ok) is ok


def test_penalty_under_remax_gives_the_baseline_that_failed():
    rule = RewardErrorRule(error_score=-0.5, needs_baseline=True)
    # Only the task's greedy baseline failed: the sample keeps its own score.
    baseline = failed(message="greedy baseline: sample uid='g/baseline': reward function f raised ...")
    baseline.score = 0.75
    out = rule.apply(baseline)
    assert out.score == 0.75 and out.baseline_score == -0.5 and not out.HasField("error")
    # The sample's own reward failed and the replica recorded no baseline: it gets both.
    out = rule.apply(failed())
    assert out.score == -0.5 and out.baseline_score == -0.5
    # Its baseline did score: kept.
    own = failed()
    own.baseline_score = 0.25
    assert rule.apply(own).baseline_score == 0.25


def test_validation_scores_by_the_rule():
    assert RewardErrorRule(error_score=-1.0).validation_score(0.0, failed=True) == -1.0
    assert RewardErrorRule(on_error="drop").validation_score(0.0, failed=True) is None
    assert RewardErrorRule(on_error="drop").validation_score(0.5, failed=False) == 0.5


def tally(samples, failures, first="sample uid='a': reward function f raised KeyError: 'x', at /u/r.py:7"):
    t = FailureTally()
    for i in range(samples):
        t.add(first if i < failures else None)
    return t


def test_the_run_stops_past_the_threshold_quoting_the_first_failure():
    rule = RewardErrorRule(max_failed_ratio=0.25)
    rule.check(tally(12, 0), "step 1")
    rule.check(tally(12, 3), "step 1")  # 25%: not more than the threshold
    with pytest.raises(RewardFailed) as e:
        rule.check(tally(12, 4), "step 3")
    text = str(e.value)
    assert text.startswith(
        "step 3: the reward failed on 4 of 12 samples (33%), more than rlmesh.reward.max_failed_ratio=0.25 "
        "allows; the run stops. The first failure:\n  sample uid='a'"
    )
    assert "at /u/r.py:7" in text and "docs/train.md#when-the-reward-fails" in text


def test_every_sample_failed_stops_whatever_the_threshold_and_0_stops_at_the_first():
    with pytest.raises(
        RewardFailed, match=r"^validation before training: .* 5 of 5 samples \(100%\), every one"
    ):
        RewardErrorRule(max_failed_ratio=1.0).check(tally(5, 5), "validation before training")
    RewardErrorRule(max_failed_ratio=1.0).check(tally(5, 4), "step 1")
    with pytest.raises(RewardFailed, match="max_failed_ratio=0 allows"):
        RewardErrorRule(max_failed_ratio=0.0).check(tally(100, 1), "step 1")


def test_tally_metrics_and_the_step_line():
    t = tally(32, 11)
    assert t.metrics("reward") == {"reward/failed": 11.0, "reward/failed_ratio": pytest.approx(11 / 32)}
    assert FailureTally().metrics("val/reward") == {"val/reward/failed": 0.0, "val/reward/failed_ratio": 0.0}
    assert step_line_part(t.metrics("reward")) == "  reward failed 34% (11)"
    assert step_line_part(FailureTally().metrics("reward")) == "" and step_line_part({}) == ""


def test_the_rule_from_config():
    rule = RewardErrorRule.from_config(load_config(None, [], warn=False))
    assert rule == RewardErrorRule(on_error="penalty", error_score=0.0, max_failed_ratio=0.5)
    cfg = load_config(
        None,
        [
            "rlmesh.reward.on_error=drop",
            "rlmesh.reward.error_score=-1",
            "rlmesh.reward.max_failed_ratio=0.1",
            "algorithm.adv_estimator=remax",
        ],
        warn=False,
    )
    assert RewardErrorRule.from_config(cfg) == RewardErrorRule("drop", -1.0, 0.1, needs_baseline=True)
    for bad in (
        "rlmesh.reward.on_error=skip",
        "rlmesh.reward.max_failed_ratio=1.5",
        "rlmesh.reward.error_score=nan",
    ):
        with pytest.raises(Exception, match=bad.split("=")[0]):
            load_config(None, [bad], warn=False)


def test_the_quoted_failure_keeps_its_lines_indented_under_the_stop_message():
    with pytest.raises(RewardFailed) as e:
        RewardErrorRule().check(tally(1, 1, first='line one\n  File "/u/r.py", line 7'), "step 1")
    assert '\n  line one\n    File "/u/r.py", line 7\n' in str(e.value)
