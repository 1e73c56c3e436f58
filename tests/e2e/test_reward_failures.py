"""``rlmesh train`` with a reward of the user's that raises: on a third of its samples the run trains
on every prompt group whole and counts the failures each step; past the threshold, or when the
reward always raises, the learner stops at once quoting the user's file and line.

The user's model, data and config are test_train's (a tiny Llama, a word-level tokenizer, raw-string
prompts, verl's keys); only the reward file differs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e.test_train import (
    build_model_and_tokenizer,
    failure_line,
    read_rows,
    rlmesh_train,
    summary_of,
    write_config,
    write_parquet,
)

N = 4  # rollout.n of test_train's config
BATCH = 8  # data.train_batch_size
VAL_ROWS = 20

# A third of the calls raise, whatever the sample: within groups, across steps and validation.
THIRD_REWARD = """\
import itertools

CALLS = itertools.count()


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if next(CALLS) % 3 == 2:
        return {"score": extra_info["confidence"]}  # RAISES
    words = solution_str.split()
    return sum(w == ground_truth for w in words) / len(words) if words else 0.0
"""
ALWAYS_REWARD = """\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth["answer"])  # RAISES: a str, not a dict
"""


def raise_line(source: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if "# RAISES" in line)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward-failures")
    build_model_and_tokenizer(root / "model")
    (root / "data").mkdir()
    write_parquet(root / "data" / "train.parquet", "train", 64, seed=1)
    write_parquet(root / "data" / "val.parquet", "val", VAL_ROWS, seed=2)
    files = {"root": root}
    for name, source in (("third", THIRD_REWARD), ("always", ALWAYS_REWARD)):
        reward = root / f"{name}_reward.py"
        reward.write_text(source)
        files[name] = reward
        files[f"{name}_config"] = write_config(
            root / f"{name}.yaml",
            train=root / "data" / "train.parquet",
            val=root / "data" / "val.parquet",
            model=root / "model",
            reward=reward,
            steps=2,
            run_dir=root / f"run-{name}",
        )
    return files


def learner_failure(log: Path) -> str:
    """The exception the learner's run ended with, from its JSON log."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    failed = [r for r in records if r.get("msg") == "training failed"]
    assert failed, log.read_text()[-3000:]
    return failed[-1]["exc"]


@pytest.mark.timeout(420)
def test_a_reward_that_raises_on_a_third_trains_on_whole_groups_and_counts_them(job):
    # The pre-flight's dry call would stop it first (its third call raises): the run's own rule is
    # under test here.
    proc = rlmesh_train(job["third_config"], "--skip-preflight")
    summary_of(proc)  # exit 0
    run_dir = job["root"] / "run-third"
    rows = read_rows(run_dir)
    steps = [r for r in rows if "timing_s/step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        # A third of the calls raised: about a third of each step's samples, none dropped.
        assert 0.25 <= row["reward/failed_ratio"] <= 0.42 and row["reward/failed"] >= 8, row
        assert row["training/dropped_invalid"] == 0.0
    # Every prompt group trained with all its samples: the batch is not thinned.
    trained = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert [len(t["groups"]) for t in trained] == [BATCH, BATCH]
    assert all(count == N for t in trained for count in t["groups"].values())
    # Validation reports them too, rather than a silent 0.0: calls 3, 6, ... 18 of the first 20.
    val = next(r for r in rows if r["step"] == 0)
    assert (val["val/reward/failed"], val["val/reward/failed_ratio"]) == (6.0, 0.3)
    # The learner's log quotes the first failure with the user's file and line.
    log = (run_dir / "services").glob("*/logs/learner.log")
    text = next(log).read_text()
    assert f"at {job['third']}:{raise_line(THIRD_REWARD)}" in text and "KeyError: 'confidence'" in text


@pytest.mark.timeout(420)
def test_past_the_threshold_or_always_raising_the_run_stops_naming_the_file_and_line(job):
    # A third fail, at most a fifth may: the validation before training stops the run.
    proc = rlmesh_train(
        job["third_config"],
        "--skip-preflight",
        "rlmesh.reward.max_failed_ratio=0.2",
        f"trainer.default_local_dir={job['root'] / 'run-threshold'}",  # not the finished run's
    )
    line, log = failure_line(proc)
    assert "the learner failed" in line and log.name == "learner.log", line
    failure = learner_failure(log)
    assert "RewardFailed: validation before training: the reward failed on " in failure
    assert "more than rlmesh.reward.max_failed_ratio=0.2 allows" in failure
    site = f"{job['third']}:{raise_line(THIRD_REWARD)}"
    assert f"KeyError: 'confidence', at {site}" in failure
    assert 'return {"score": extra_info["confidence"]}  # RAISES' in failure
    assert f"KeyError: 'confidence', at {site}" in proc.stderr  # on the terminal, not only the log

    # A reward that always raises: the pre-flight's dry call stops it before anything starts.
    proc = rlmesh_train(job["always_config"])
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{job['always']}:{raise_line(ALWAYS_REWARD)}" in proc.stderr, proc.stderr
    assert "TypeError: string indices must be integers" in proc.stderr
    assert not (job["root"] / "run-always" / "services").exists()

    # Past the pre-flight, no validation first: step 1 stops, not build_batch, not 30 s on.
    proc = rlmesh_train(job["always_config"], "--skip-preflight", "trainer.val_before_train=false")
    line, log = failure_line(proc)
    assert "the learner failed" in line and log.name == "learner.log", line
    failure = learner_failure(log)
    # A batch's worth at least (samples of the next step's prompts may be in already).
    counted = re.search(
        r"RewardFailed: step 1: the reward failed on (\d+) of \1 samples \(100%\), every one", failure
    )
    assert counted and int(counted[1]) >= BATCH * N, failure[-3000:]
    assert "TypeError: string indices must be integers" in failure
    assert f"at {job['always']}:{raise_line(ALWAYS_REWARD)}" in failure
    assert "build_batch" not in failure
    metrics = job["root"] / "run-always" / "metrics.jsonl"
    assert not metrics.exists() or not any("timing_s/step" in r for r in read_rows(metrics.parent))
