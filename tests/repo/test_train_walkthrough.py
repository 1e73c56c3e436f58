"""docs/train.md's walkthrough (bring your own model, data and reward) works as written: its files
and commands, run in order in an empty directory, give a warmed-up model, a reward with extra
values and a config that validates. The ``rlmesh train`` at its end is
tests/e2e/test_train_walkthrough.py's."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import yaml

from rlmesh.reward.function_loader import load_reward_function
from tests.support.walkthrough import follow, walkthrough_steps


def test_the_walkthrough_has_each_piece_in_the_order_they_depend_on():
    steps = walkthrough_steps()
    order = [s.file or " ".join(s.argv[:3]) for s in steps]
    assert order == [
        "make_data.py", "python make_data.py",
        "make_tokenizer.py", "python make_tokenizer.py",
        "make_model.py", "python make_model.py",
        "my_reward.py",
        "rlmesh sft --model",
        "my_job.yaml",
        "rlmesh config validate", "rlmesh train -c",
    ]  # fmt: skip


def test_the_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    train: list[list[str]] = []
    follow(tmp_path, train=train.append)
    out = capsys.readouterr().out

    # 1. The data: verl's columns with the types the table of docs/train.md#data-layout gives.
    schema = pq.read_schema(tmp_path / "data" / "train.parquet")
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert str(schema.field("prompt").type) == "list<element: struct<role: string, content: string>>"
    assert str(schema.field("reward_model").type) == "struct<style: string, ground_truth: string>"
    assert pq.read_metadata(tmp_path / "data" / "train.parquet").num_rows == 400

    # 5. The warm-up trained on every row and learnt something: dev scores by the user's reward.
    assert "sft: 400 examples from data/train.parquet" in out
    scores = [float(s) for s in re.findall(r"dev score (\d\.\d+)", out)]
    assert len(scores) == 3 and scores[-1] > 0.1, out
    assert (tmp_path / "my_model_sft" / "model.safetensors").exists()
    assert (tmp_path / "my_model_sft" / "tokenizer.json").exists()

    # 4. The reward returns the score and numbers the learner logs.
    reward = load_reward_function(str(tmp_path / "my_reward.py"))
    assert reward.call("sort_digits", "1 2 3", "1 2 3", {}) == {
        "score": 1.0,
        "well_formed": 1.0,
        "length": 3.0,
    }
    assert reward.call("sort_digits", "1 x", "1 2 3", {})["well_formed"] == 0.0

    # 6-7. The config validates and names files that exist; `rlmesh train` takes it.
    assert "configuration is valid" in out
    config = yaml.safe_load((tmp_path / "my_job.yaml").read_text())
    for path in (
        config["data"]["train_files"],
        config["data"]["val_files"],
        config["actor_rollout_ref"]["model"]["path"],
        config["custom_reward_function"]["path"],
    ):
        assert (tmp_path / path).exists(), path
    assert train == [["train", "-c", "my_job.yaml"]]
