"""Supervised warm-up on the arithmetic task lowers the loss, deterministically, and saves an HF dir."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.data import make_arithmetic_rows
from rlmesh.data.layout import write_rows
from rlmesh.learner.sft import main as sft_main
from rlmesh.learner.sft import run_sft


def test_sft_lowers_the_loss_and_is_deterministic(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = [(tok.encode(f"{a}+{b}=", add_special_tokens=False), tok.encode(f"#### {a + b}<|endoftext|>"))
                for a in range(4) for b in range(4)]  # fmt: skip
    lines: list[str] = []
    first = run_sft(str(tiny_model_dir), str(tmp_path / "a"), examples, epochs=3, lr=3e-3, batch_size=4, seed=0,
                    log_fn=lines.append)  # fmt: skip
    assert first["final_loss"] < 0.7 * first["initial_loss"], first
    assert first["epoch_losses"][-1] < first["epoch_losses"][0]
    assert sum("sft epoch" in line for line in lines) == 3
    second = run_sft(str(tiny_model_dir), str(tmp_path / "b"), examples, epochs=3, lr=3e-3, batch_size=4, seed=0,
                     log_fn=lambda _: None)  # fmt: skip
    assert second["epoch_losses"] == first["epoch_losses"]
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)


def test_sft_command_on_arithmetic_parquet(tiny_model_dir, tmp_path, capsys):
    rows = make_arithmetic_rows(seed=0, train_size=24, val_size=4)
    data = write_rows(rows["train"], tmp_path / "train.parquet")
    out = tmp_path / "sft"
    argv = ["--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--epochs", "2",
            "--lr", "3e-3", "--batch-size", "8"]  # fmt: skip
    assert sft_main(argv) == 0
    printed = capsys.readouterr().out
    assert "sft epoch 1/2" in printed and "sft epoch 2/2" in printed
    model = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).apply_chat_template is not None
    assert model.config.vocab_size == 100


def test_sft_command_refuses_data_without_arithmetic_rows(tiny_model_dir, tmp_path, capsys):
    rows = make_arithmetic_rows(seed=0, train_size=4, val_size=1)["train"]
    for row in rows:
        row["data_source"] = "openai/gsm8k"
    data = write_rows(rows, tmp_path / "gsm.parquet")
    assert sft_main(["--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "x")]) == 1
    captured = capsys.readouterr()
    assert "skipped 4 rows" in captured.out and "no arithmetic rows" in captured.err


@pytest.mark.parametrize("bad", [{"epochs": 0}, {"batch_size": 0}])
def test_run_sft_rejects_bad_arguments(tiny_model_dir, tmp_path, bad):
    with pytest.raises(ValueError):
        run_sft(str(tiny_model_dir), str(tmp_path), [([1], [2])], **bad)
