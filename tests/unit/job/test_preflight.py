"""The pre-flight of a job: each mistake a user makes with the model, tokenizer, data or reward is a
problem naming its file, row, key or line; every problem is reported, not only the first."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest

from rlmesh.config import load_config
from rlmesh.job.preflight import run_preflight
from tests.support.data import row, write
from tests.support.preflight import MAX_PROMPT_LENGTH, SOURCE, TRAIN_ROWS, VAL_ROWS, long_rows, make_job


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return make_job(tmp_path_factory.mktemp("preflight"))


def preflight(job, *overrides: str):
    return run_preflight(load_config(job.config, list(overrides), warn=False))


def only_problem(report) -> str:
    assert len(report.problems) == 1, report.problems
    return report.problems[0]


def test_a_valid_job_has_no_problem_and_says_what_was_checked(job):
    said = []
    report = run_preflight(load_config(job.config, [], warn=False), progress=said.append)
    assert report.problems == [] and report.notes == [] and report.finished is None
    checked = "\n".join(report.checked)
    assert (
        f"data.train_files: {TRAIN_ROWS} prompts" in checked
        and f"data.val_files: {VAL_ROWS} prompts" in checked
    )
    assert f"tokenizer: {job.model}" in checked and f"model: {job.model} (qwen2, vocab_size 100)" in checked
    # The reward file was called: 0 for an empty response, 1 for the ground truth.
    assert (
        f"reward: {job.reward}:compute_score; called on 2 rows" in checked and "scores 0, 1, 0, 1" in checked
    )
    assert f"resume: nothing in {job.run_dir}" in checked
    assert not job.run_dir.exists()  # nothing created
    assert any("reading data.train_files" in s for s in said) and any("calling the reward" in s for s in said)


def test_missing_files_are_each_named_with_their_key(job, tmp_path):
    report = preflight(
        job,
        f"data.train_files=[{job.train},{tmp_path / 'a.parquet'}]",
        f"data.val_files={tmp_path / 'b.parquet'}",
        f"custom_reward_function.path={tmp_path / 'reward.py'}",
    )
    assert report.problems[:2] == [
        f"data.train_files: {tmp_path / 'a.parquet'}: no such file",
        f"data.val_files: {tmp_path / 'b.parquet'}: no such file",
    ]
    assert "custom_reward_function.path=" in report.problems[2] and "no such file" in report.problems[2]
    assert str(tmp_path / "reward.py") in report.problems[2] and len(report.problems) == 3


def test_a_missing_model_directory_is_one_problem(job, tmp_path):
    problem = only_problem(preflight(job, f"actor_rollout_ref.model.path={tmp_path / 'no-model'}"))
    assert problem == f"actor_rollout_ref.model.path={tmp_path / 'no-model'}: no such directory"


def test_a_model_directory_without_config_or_weights(job, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("")
    report = preflight(job, f"actor_rollout_ref.model.path={empty}", f"data.tokenizer={job.model}")
    assert only_problem(report) == (
        f"actor_rollout_ref.model.path={empty}: no config.json in it, so no HF model directory (it holds: notes.txt)"
    )
    no_weights = tmp_path / "no-weights"
    shutil.copytree(job.model, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    problem = only_problem(preflight(job, f"actor_rollout_ref.model.path={no_weights}"))
    assert problem.startswith(f"actor_rollout_ref.model.path={no_weights}: no weights in it")


def test_a_missing_tokenizer(job, tmp_path):
    bare = tmp_path / "bare-model"  # config and weights, no tokenizer files
    shutil.copytree(job.model, bare, ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))
    problem = only_problem(preflight(job, f"actor_rollout_ref.model.path={bare}"))
    assert problem.startswith(
        f"actor_rollout_ref.model.path={bare}: no tokenizer in it (none of tokenizer.json"
    )
    assert "set data.tokenizer" in problem
    problem = only_problem(preflight(job, f"data.tokenizer={tmp_path / 'tok'}"))
    assert problem == f"data.tokenizer={tmp_path / 'tok'}: no such directory, so no tokenizer"


def test_a_tokenizer_with_ids_beyond_the_models_vocabulary(job, tmp_path):
    small = tmp_path / "small-vocab"
    shutil.copytree(job.model, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 60}))
    report = preflight(job, f"actor_rollout_ref.model.path={small}")
    text = "\n".join(report.problems)
    assert "the tokenizer's eos_token_id is 96, not below the model's vocab_size 60" in text
    assert (
        f"data.train_files: {job.train}, row 0: token id" in text
        and "is not below the model's vocab_size 60" in text
    )


def test_a_reward_file_that_does_not_import_names_its_line(job, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None)\n    return 1.0\n"
    )
    problem = only_problem(preflight(job, f"custom_reward_function.path={broken}"))
    assert "raised SyntaxError" in problem and f"at {broken}:1" in problem
    raising = tmp_path / "raising.py"
    raising.write_text("import os\n\nGPU = os.environ['NO_SUCH_VARIABLE_HERE']\n")
    problem = only_problem(preflight(job, f"custom_reward_function.path={raising}"))
    assert "raised KeyError: 'NO_SUCH_VARIABLE_HERE'" in problem and f"at {raising}:3" in problem


def test_a_reward_function_with_the_wrong_signature(job, tmp_path):
    wrong = tmp_path / "wrong.py"
    wrong.write_text("import math\n\n\ndef compute_score(solution, truth):\n    return 0.0\n")
    problem = only_problem(preflight(job, f"custom_reward_function.path={wrong}"))
    assert "signature (solution, truth) does not fit" in problem and f"defined at {wrong}:4" in problem
    problem = only_problem(
        preflight(job, f"custom_reward_function.path={wrong}", "custom_reward_function.name=score")
    )
    assert "has no attribute 'score'" in problem and "compute_score" in problem


def test_a_reward_that_raises_on_the_dry_call_names_the_users_file_and_line(job, tmp_path):
    reward = tmp_path / "dict_truth.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    answer = ground_truth['answer']\n"
        "    return float(solution_str == answer)\n"
    )
    problem = only_problem(preflight(job, f"custom_reward_function.path={reward}"))  # 4 calls, 1 failure
    assert problem.startswith(
        f"the reward called on data.train_files: {job.train}, rows 0, 1, each with an empty response and "
        "with its ground truth as the response: "
    )
    assert "raised TypeError: string indices must be integers" in problem and f"at {reward}:2" in problem
    assert "answer = ground_truth['answer']" in problem  # the user's line, quoted

    # Only some calls fail: those are named.
    picky = tmp_path / "picky.py"
    picky.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 / len(solution_str)\n"
    )
    problem = only_problem(preflight(job, f"custom_reward_function.path={picky}"))
    assert problem.startswith(
        f"the reward called on data.train_files: {job.train}, row 0, with an empty response; "
        f"{job.train}, row 1, with an empty response: "
    )
    assert "ZeroDivisionError" in problem and f"at {picky}:2" in problem


def test_a_reward_that_returns_no_number(job, tmp_path):
    reward = tmp_path / "none.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    pass\n"
    )
    problem = only_problem(preflight(job, f"custom_reward_function.path={reward}"))
    assert problem.endswith(f"reward function {reward}:compute_score returned NoneType None, not a number")


def test_parquet_without_the_reward_model_column(job, tmp_path):
    rows = pq.read_table(job.train).to_pylist()
    for r in rows:
        del r["reward_model"]
    bad = write(tmp_path / "no_gt.parquet", rows)
    problem = only_problem(preflight(job, f"data.train_files={bad}"))
    assert problem.startswith(f"data.train_files: {bad}, column 'reward_model': missing column")
    assert "ground_truth" in problem and "(the file has: " in problem


def test_overlong_prompts_are_all_counted_with_full_key_names(job, tmp_path):
    long = write(tmp_path / "long.parquet", long_rows(20, long_every=3))  # rows 1, 4, 7, ..., 19
    problem = only_problem(preflight(job, f"data.train_files={long}"))
    assert problem.startswith(
        f"data.train_files: {long}, column 'prompt': 7 of 20 prompts are longer than "
        f"data.max_prompt_length={MAX_PROMPT_LENGTH} tokens: row 1 ("
    )
    assert "row 13 (" in problem and "and 2 more; the longest is row 19 (" in problem
    assert "Raise data.max_prompt_length, set data.truncation to left, right or middle, or set " in problem
    assert "data.filter_overlong_prompts=true to drop them" in problem

    # Cut or dropped instead: not a problem, a note saying how many.
    report = preflight(job, f"data.train_files={long}", "data.truncation=left")
    assert report.problems == [] and len(report.notes) == 1
    assert report.notes[0].startswith(
        "data.train_files: 7 of 20 prompts are longer than data.max_prompt_length="
    )
    assert report.notes[0].endswith("they will be truncated (data.truncation=left)")
    report = preflight(job, f"data.train_files={long}", "data.filter_overlong_prompts=true")
    assert report.problems == [] and report.notes[0].endswith(
        "they are left out (data.filter_overlong_prompts=true)"
    )
    assert "data.train_files: 13 prompts" in "\n".join(report.checked)


def test_an_unknown_data_source_without_a_reward_function(job, tmp_path):
    mixed = write(
        tmp_path / "mixed.parquet",
        [row("1+1", gt="2", source="arithmetic"), *(row(f"q{i}", source=SOURCE) for i in range(3))],
    )
    report = preflight(job, f"data.train_files={mixed}", "custom_reward_function.path=null")
    problems = "\n".join(report.problems)
    assert len(report.problems) == 2  # the train file's my_task rows, the val file's
    assert (
        f"data.train_files: {mixed}, row 1 (and 2 more rows): no built-in reward for data_source 'my_task'"
        in problems
    )
    assert "openai/gsm8k=gsm8k" in problems and "custom_reward_function.path" in problems
    assert "'arithmetic'" not in problems  # a built-in knows it
    # A built-in forced for every sample scores any data_source: no problem.
    assert preflight(job, f"data.train_files={mixed}", "custom_reward_function.path=null",
                     "rlmesh.reward.function=arithmetic").problems == []  # fmt: skip


def test_several_problems_are_all_reported(job, tmp_path):
    long = write(tmp_path / "long.parquet", long_rows(6, long_every=3))
    report = preflight(
        job,
        f"data.train_files={long}",
        f"data.val_files={tmp_path / 'nope.parquet'}",
        f"custom_reward_function.path={tmp_path / 'nope.py'}",
    )
    assert len(report.problems) == 3, report.problems
    assert "2 of 6 prompts are longer" in report.problems[0]
    assert "data.val_files" in report.problems[1] and "custom_reward_function.path" in report.problems[2]


def test_a_reward_served_elsewhere_is_not_called_here(job, tmp_path):
    report = preflight(
        job,
        f"custom_reward_function.path={tmp_path / 'theirs.py'}",
        "rlmesh.reward.addresses=['10.0.0.9:50051']",
    )
    assert report.problems == [] and "10.0.0.9:50051" in report.notes[0]
