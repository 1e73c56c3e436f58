import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlmesh.data import DatasetError, RLHFDataset, convert_gsm8k, extract_gsm8k_solution

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
RECORDS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 more. Total?", "answer": "It is 1,200+3,000.\n#### 4,200"},
    {"question": "Debt?", "answer": "She owes it.\n#### -5"},
]


def write_jsonl(path, records, blank_line=False):
    lines = [json.dumps(r) for r in records]
    if blank_line:
        lines.insert(1, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def check_output(path, split):
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == 3
    for i, (r, rec) in enumerate(zip(rows, RECORDS, strict=True)):
        assert r["data_source"] == "openai/gsm8k" and r["ability"] == "math"
        assert r["prompt"] == [{"role": "user", "content": rec["question"] + " " + INSTRUCTION}]
        assert r["extra_info"] == {
            "split": split,
            "index": i,
            "answer": rec["answer"],
            "question": rec["question"],
        }
    assert [r["reward_model"] for r in rows] == [
        {"style": "rule", "ground_truth": g} for g in ("7", "4200", "-5")
    ]


def test_from_jsonl(tmp_path):
    src = write_jsonl(tmp_path / "train.jsonl", RECORDS, blank_line=True)
    path, n = convert_gsm8k(src, tmp_path / "out")
    assert (path, n) == (tmp_path / "out" / "train.parquet", 3)
    check_output(path, "train")


def test_from_parquet_test_split(tmp_path, tok):
    src = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), str(src))
    path, n = convert_gsm8k(src, tmp_path / "out", split="test")
    assert path.name == "test.parquet" and n == 3
    check_output(path, "test")
    ds = RLHFDataset(path, tok, max_prompt_length=256)  # the output reads back as a dataset
    assert [i.ground_truth for i in ds] == ["7", "4200", "-5"]


def test_extract_solution():
    assert extract_gsm8k_solution("so\n#### 1,234.5") == "1234.5"
    assert extract_gsm8k_solution("no marker 42") is None
    assert extract_gsm8k_solution("####42") is None  # verl's pattern wants "#### "


@pytest.mark.parametrize(
    ("record", "field", "words"),
    [
        ({"answer": "#### 1"}, "question", "missing"),
        ({"question": "q?"}, "answer", "missing"),
        ({"question": "q?", "answer": 7}, "answer", "expected a string"),
        ({"question": "q?", "answer": "it is 7"}, "answer", "####"),
    ],
)
def test_bad_jsonl_names_line_and_field(tmp_path, record, field, words):
    src = write_jsonl(tmp_path / "bad.jsonl", [*RECORDS[:2], record], blank_line=True)  # record is on line 4
    with pytest.raises(DatasetError) as e:
        convert_gsm8k(src, tmp_path / "out")
    msg = str(e.value)
    assert str(src) in msg and "line 4" in msg and f"field {field!r}" in msg and words in msg


def test_bad_parquet_names_row_and_column(tmp_path):
    src = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([*RECORDS, {"question": "q", "answer": "no final answer"}]), str(src))
    with pytest.raises(DatasetError) as e:
        convert_gsm8k(src, tmp_path / "out")
    assert str(src) in str(e.value) and "row 3" in str(e.value) and "column 'answer'" in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(DatasetError, match=r"nope\.jsonl"):
        convert_gsm8k(tmp_path / "nope.jsonl", tmp_path / "out")
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(DatasetError, match=r"line 2.*not valid JSON"):
        convert_gsm8k(junk, tmp_path / "out")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match="no records"):
        convert_gsm8k(empty, tmp_path / "out")
    arr = tmp_path / "arr.jsonl"
    arr.write_text("[1, 2]\n")
    with pytest.raises(DatasetError, match="line 1"):
        convert_gsm8k(arr, tmp_path / "out")
