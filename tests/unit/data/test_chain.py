import re

import pyarrow.parquet as pq
import pytest

from rlmesh.data import CHAIN_DATA_SOURCE, generate_chain, make_chain_rows, response_lengths
from rlmesh.data.cli import main as data_main
from rlmesh.reward.builtin import BUILTIN_FUNCTIONS, builtin_for

PROMPT = re.compile(
    r'^Start at (\d+), then ((?:[+-]\d+ ?)+)\. Write each running total, then the last after "####"\.$'
)


def read(path):
    return pq.read_table(path).to_pylist()


def parse(row):
    (msg,) = row["prompt"]
    start, deltas = PROMPT.match(msg["content"]).groups()
    return int(start), [int(d) for d in deltas.split()]


def test_rows_hold_the_chain_its_solution_and_the_last_total(tmp_path):
    paths = generate_chain(tmp_path, seed=3, train_size=300, val_size=40)
    for split, n in (("train", 300), ("test", 40)):
        rows = read(paths[split])
        assert len(rows) == n
        for r in rows:
            assert r["data_source"] == CHAIN_DATA_SOURCE
            start, deltas = parse(r)
            assert r["extra_info"]["steps"] == len(deltas) and all(1 <= abs(d) <= 9 for d in deltas)
            # Running totals, worked out apart from the generator.
            totals = [start + sum(deltas[: i + 1]) for i in range(len(deltas))]
            assert r["extra_info"]["solution"] == " ".join(map(str, totals)) + f" #### {totals[-1]}"
            assert r["reward_model"]["ground_truth"] == str(totals[-1])


def test_the_rule_reward_scores_the_solution_and_nothing_else(tmp_path):
    (row, *_) = make_chain_rows(0, train_size=5, val_size=1)["train"]
    score = BUILTIN_FUNCTIONS[builtin_for(CHAIN_DATA_SOURCE)]
    truth = row["reward_model"]["ground_truth"]
    assert score(CHAIN_DATA_SOURCE, row["extra_info"]["solution"], truth)["score"] == 1.0
    wrong = row["extra_info"]["solution"].rsplit("#### ", 1)[0] + f"#### {int(truth) + 1}"
    assert score(CHAIN_DATA_SOURCE, wrong, truth)["score"] == 0.0
    assert score(CHAIN_DATA_SOURCE, row["extra_info"]["solution"].split(" ####")[0], truth)["score"] == 0.0


def test_lengths_have_a_long_tail_and_a_flat_draw_has_none():
    long_tail = response_lengths(make_chain_rows(1, train_size=2000, val_size=10)["train"])
    assert long_tail["max_over_p50"] >= 5 and long_tail["p99"] >= 4 * long_tail["p50"]
    flat = response_lengths(make_chain_rows(1, train_size=2000, val_size=10, tail=0, max_steps=3)["train"])
    assert flat["max_over_p50"] < 3


def test_deterministic_disjoint_and_checked(tmp_path):
    a, b = make_chain_rows(7, train_size=200, val_size=40), make_chain_rows(7, train_size=200, val_size=40)
    assert a == b and a != make_chain_rows(8, train_size=200, val_size=40)
    prompts = {s: {r["prompt"][0]["content"] for r in rows} for s, rows in a.items()}
    assert not prompts["train"] & prompts["test"] and len(prompts["train"]) == 200
    with pytest.raises(ValueError, match="max_steps"):
        make_chain_rows(0, max_steps=0)
    with pytest.raises(ValueError, match="distinct chains"):
        make_chain_rows(0, train_size=500, max_steps=1, max_start=2, max_delta=1)


def test_the_command_prints_each_splits_length_distribution(tmp_path, capsys):
    assert data_main(["chain", "--out", str(tmp_path), "--train-size", "100", "--val-size", "20"]) == 0
    out = capsys.readouterr().out
    for split, n in (("train", 100), ("test", 20)):
        line = next(ln for ln in out.splitlines() if f"({n} {split} rows)" in ln)
        rows = read(tmp_path / f"{split}.parquet")
        lengths = response_lengths(rows)
        assert f"p50 {lengths['p50']}, p90 {lengths['p90']}" in line and f"max {lengths['max']}" in line
