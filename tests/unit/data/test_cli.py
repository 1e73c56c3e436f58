import json

import pyarrow.parquet as pq

from rlmesh.data.cli import main


def test_help_lists_both_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "arithmetic" in out and "gsm8k" in out
    assert main(["arithmetic", "--help"]) == 0
    assert "--max-operand" in capsys.readouterr().out


def test_arithmetic_command(tmp_path, capsys):
    rc = main(["arithmetic", "--out", str(tmp_path), "--seed", "3", "--train-size", "20", "--val-size", "5",
               "--min-terms", "3", "--max-terms", "3", "--max-operand", "9", "--ops", "+-"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert (
        f"{tmp_path / 'train.parquet'} (20 train rows)" in out
        and f"{tmp_path / 'test.parquet'} (5 test rows)" in out
    )
    exprs = [
        r["expression"] for r in pq.read_table(tmp_path / "train.parquet").column("extra_info").to_pylist()
    ]
    assert all(len(e) >= 5 and "*" not in e for e in exprs)


def test_gsm8k_command(tmp_path, capsys):
    src = tmp_path / "test.jsonl"
    src.write_text(json.dumps({"question": "q?", "answer": "x\n#### 3"}) + "\n")
    assert main(["gsm8k", "--input", str(src), "--out", str(tmp_path / "o"), "--split", "test"]) == 0
    assert f"{tmp_path / 'o' / 'test.parquet'} (1 test rows)" in capsys.readouterr().out


def test_errors_return_nonzero(tmp_path, capsys):
    assert main(["gsm8k", "--input", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)]) == 1
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["arithmetic", "--out", str(tmp_path), "--ops", "/"]) == 1
    assert main(["nope"]) == 2
    assert main([]) == 2
