import re

import pyarrow.parquet as pq
import pytest

from rlmesh.data import RLHFDataset, evaluate_expression, format_arithmetic_solution, generate_arithmetic
from rlmesh.data.arithmetic import count_expressions, make_arithmetic_rows

PROMPT = re.compile(r'^What is ([0-9+\-*]+)\? Answer after "####"\.$')


def read(path):
    return pq.read_table(path).to_pylist()


def test_writes_verl_layout_with_correct_answers(tmp_path):
    paths = generate_arithmetic(tmp_path, seed=1, train_size=300, val_size=50)
    assert paths == {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}
    for split, n in (("train", 300), ("test", 50)):
        rows = read(paths[split])
        assert len(rows) == n
        for i, r in enumerate(rows):
            assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert r["data_source"] == "arithmetic" and r["ability"] == "math"
            assert r["extra_info"]["split"] == split and r["extra_info"]["index"] == i
            (msg,) = r["prompt"]
            expr = PROMPT.match(msg["content"]).group(1)
            assert msg["role"] == "user" and expr == r["extra_info"]["expression"]
            assert r["reward_model"] == {
                "style": "rule",
                "ground_truth": str(eval(expr)),
            }  # independent check


def test_deterministic_and_disjoint(tmp_path):
    a = generate_arithmetic(tmp_path / "a", seed=7, train_size=200, val_size=40)
    b = generate_arithmetic(tmp_path / "b", seed=7, train_size=200, val_size=40)
    c = generate_arithmetic(tmp_path / "c", seed=8, train_size=200, val_size=40)
    assert read(a["train"]) == read(b["train"]) and read(a["test"]) == read(b["test"])
    assert read(a["train"]) != read(c["train"])
    train = [r["extra_info"]["expression"] for r in read(a["train"])]
    test = [r["extra_info"]["expression"] for r in read(a["test"])]
    assert len(set(train)) == 200 and len(set(test)) == 40 and not set(train) & set(test)
    # The test split for a seed does not depend on train_size.
    bigger = make_arithmetic_rows(7, train_size=500, val_size=40)
    assert bigger["test"] == read(a["test"])


def test_dev_split_is_disjoint_and_leaves_the_test_split_alone():
    plain = make_arithmetic_rows(3, train_size=300, val_size=50)
    rows = make_arithmetic_rows(3, train_size=300, val_size=50, dev_size=60)
    expr = {split: {r["extra_info"]["expression"] for r in rs} for split, rs in rows.items()}
    assert {split: len(e) for split, e in expr.items()} == {"test": 50, "dev": 60, "train": 300}
    assert (
        not expr["dev"] & expr["train"]
        and not expr["dev"] & expr["test"]
        and not expr["train"] & expr["test"]
    )
    assert rows["test"] == plain["test"]
    assert {r["extra_info"]["split"] for r in rows["dev"]} == {"dev"}
    assert "dev" not in plain
    with pytest.raises(ValueError, match="dev_size"):
        make_arithmetic_rows(3, dev_size=-1)


def test_difficulty_knobs():
    rows = make_arithmetic_rows(
        0, train_size=100, val_size=10, min_terms=4, max_terms=4, max_operand=5, ops="*"
    )
    for r in rows["train"] + rows["test"]:
        nums = r["extra_info"]["expression"].split("*")
        assert len(nums) == 4 and all(0 <= int(n) <= 5 for n in nums)
    with pytest.raises(ValueError, match="allow only"):
        make_arithmetic_rows(0, train_size=100, val_size=10, min_terms=2, max_terms=2, max_operand=3, ops="+")
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic_rows(0, ops="/")
    assert count_expressions(2, 2, 3, "+") == 16


@pytest.mark.parametrize("expr", ["1+2", "12+7-3", "2*3+4*5", "0-9*9-1", "7", "3*0*5-2", "20-3*4+1*2*3"])
def test_evaluate_expression(expr):
    assert evaluate_expression(expr) == eval(expr)


def test_evaluate_rejects_junk():
    for bad in ["", "1+", "+1", "1/2", "1 + 2", "(1)"]:
        with pytest.raises(ValueError):
            evaluate_expression(bad)


def test_solution_format_and_prompt_length(tmp_path, tok):
    assert format_arithmetic_solution(16) == format_arithmetic_solution("16") == "#### 16"
    assert format_arithmetic_solution(-4) == "#### -4"
    paths = generate_arithmetic(tmp_path, seed=0, train_size=200, val_size=20)
    ds = RLHFDataset(paths["train"], tok, max_prompt_length=64)  # 3-term prompts fit a 64-token budget
    assert max(len(i.prompt_ids) for i in ds) <= 64
