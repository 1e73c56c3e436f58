"""Supervised warm-up on the arithmetic task lowers the loss, deterministically, and saves an HF dir."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.data import RLHFDataset, make_arithmetic_rows
from rlmesh.data.layout import write_rows
from rlmesh.learner.sft import greedy_accuracy, run_sft
from rlmesh.learner.sft import main as sft_main
from rlmesh.models import build_tiny_model, build_tokenizer, load_tokenizer


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


def addition_examples(tok):
    return [(tok.encode(f"{a}+{b}=", add_special_tokens=False), tok.encode(f"#### {a + b}<|endoftext|>"))
            for a in range(4) for b in range(4)]  # fmt: skip


def test_sft_stops_at_the_first_dev_score_in_the_band(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen_steps: list[float] = []

    def rising_score(model) -> float:  # a held-out score that rises by 0.1 per check
        seen_steps.append(len(seen_steps))
        return 0.1 * len(seen_steps)

    result = run_sft(str(tiny_model_dir), str(tmp_path / "a"), addition_examples(tok), epochs=50, lr=3e-3,
                     batch_size=4, seed=0, log_fn=lambda _: None, evaluate=rising_score, eval_every=3,
                     stop_at=0.35)  # fmt: skip
    assert result["reached"] and result["dev_score"] == pytest.approx(0.4)
    assert [step for step, _ in result["evals"]] == [3, 6, 9, 12] and result["steps"] == 12
    assert (tmp_path / "a" / "model.safetensors").exists()

    never = run_sft(str(tiny_model_dir), str(tmp_path / "b"), addition_examples(tok), epochs=2, lr=3e-3,
                    batch_size=4, seed=0, log_fn=lambda _: None, evaluate=lambda m: 0.0, eval_every=3,
                    stop_at=0.5)  # fmt: skip
    assert not never["reached"] and never["steps"] == 8 and never["evals"][-1] == [8, 0.0]


def test_greedy_accuracy_of_a_left_padded_batch_equals_one_prompt_at_a_time(tmp_path):
    rows = make_arithmetic_rows(seed=0, train_size=24, val_size=12)
    path = write_rows(rows["test"], tmp_path / "test.parquet")
    base = build_tiny_model(tmp_path / "base", build_tokenizer(), hidden_size=32, num_layers=2, seed=0)
    tok = load_tokenizer(base)
    items = RLHFDataset(str(path), tok, max_prompt_length=512).items
    assert len({len(it.prompt_ids) for it in items}) > 1  # prompts of several lengths: padding matters
    # Train toward one item's answer so some greedy answers are right and scores are not all 0.
    target = tok.encode(f"#### {items[0].ground_truth}<|endoftext|>", add_special_tokens=False)
    run_sft(str(base), str(tmp_path / "m"), [(items[0].prompt_ids, target)] * 8, epochs=80, lr=1e-2,
            batch_size=8, seed=0, log_fn=lambda _: None)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    batched = greedy_accuracy(model, tok, items, max_new_tokens=8)
    single = sum(greedy_accuracy(model, tok, [it], max_new_tokens=8) for it in items) / len(items)
    assert batched == pytest.approx(single) and batched > 0


def test_sft_command_fails_when_the_dev_band_is_not_reached(tiny_model_dir, tmp_path, capsys):
    rows = make_arithmetic_rows(seed=0, train_size=24, val_size=4, dev_size=6)
    data = write_rows(rows["train"], tmp_path / "train.parquet")
    dev = write_rows(rows["dev"], tmp_path / "dev.parquet")
    argv = ["--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "sft"), "--epochs", "1",
            "--batch-size", "8", "--dev", str(dev), "--eval-every", "2", "--stop-at", "0.99"]  # fmt: skip
    assert sft_main(argv) == 1
    assert "not 0.99" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sft_main(
            [
                "--model",
                str(tiny_model_dir),
                "--data",
                str(data),
                "--out",
                str(tmp_path / "x"),
                "--stop-at",
                "0.5",
            ]
        )
