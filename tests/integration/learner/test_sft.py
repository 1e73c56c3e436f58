"""Supervised warm-up lowers the loss, deterministically, and saves an HF dir; ``rlmesh sft`` trains
on any verl-layout Parquet, prompt to a target column plus eos, and names the row it cannot use."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.data import RLHFDataset, make_arithmetic_rows
from rlmesh.data.layout import write_rows
from rlmesh.learner.sft import arithmetic_examples, greedy_accuracy, run_sft, sft_examples
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


def my_rows(count: int = 6) -> list[dict]:
    """A task of the user's own: no built-in reward knows its data source."""
    return [
        {
            "data_source": "my_task",
            "prompt": [{"role": "user", "content": f"echo {i}"}],
            "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": f"{i}{i}"},
            "extra_info": {"index": i, "answer": f"answer {i}"},
            "answer": f"top {i}",
        }
        for i in range(count)
    ]


def write_table(rows: list[dict], path) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def test_the_demo_warm_up_examples_are_unchanged(tiny_model_dir, tmp_path):
    """The demo trains on ``#### <answer>`` + eos of each arithmetic row: the CLI's default gives the
    same examples, and both are what the warm-up encoded before any target column existed."""
    data = write_rows(
        make_arithmetic_rows(seed=0, train_size=24, val_size=4)["train"], tmp_path / "a.parquet"
    )
    tok = load_tokenizer(tiny_model_dir)
    demo, skipped = arithmetic_examples(str(data), tok)
    assert skipped == {} and len(demo) == 24
    assert sft_examples(str(data), tok) == demo
    items = RLHFDataset(str(data), tok).items
    assert demo == [
        (it.prompt_ids, tok.encode(f"#### {it.ground_truth}<|endoftext|>", add_special_tokens=False))
        for it in items
    ]


def test_any_data_source_trains_toward_its_ground_truth_then_eos(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    data = write_table(my_rows(), tmp_path / "mine.parquet")
    examples = sft_examples(data, tok)
    items = RLHFDataset(data, tok).items
    assert [p for p, _ in examples] == [it.prompt_ids for it in items]  # the RL prompt, templated
    assert tok.decode(examples[0][0]) == "<|im_start|>user\necho 0<|im_end|>\n<|im_start|>assistant\n"
    assert [t for _, t in examples] == [[*tok.encode(f"{i}{i}"), tok.eos_token_id] for i in range(6)]


@pytest.mark.parametrize(
    ("key", "fmt", "target"),
    [
        ("extra_info.answer", None, "answer 3"),
        ("answer", None, "top 3"),
        ("extra_info.index", None, "3"),  # a number, as text
        ("reward_model.ground_truth", "#### {target}", "#### 33"),
    ],
)
def test_the_target_is_the_column_or_struct_field_named_in_the_format_given(
    tiny_model_dir, tmp_path, key, fmt, target
):
    tok = load_tokenizer(tiny_model_dir)
    rows = my_rows()
    for row in rows:  # the rows need no ground truth when the target is elsewhere
        row["reward_model"] = None if key != "reward_model.ground_truth" else row["reward_model"]
    examples = sft_examples(write_table(rows, tmp_path / "t.parquet"), tok, target_key=key, target_format=fmt)
    assert tok.decode(examples[3][1]) == target + tok.eos_token


def test_a_row_without_a_target_is_an_error_naming_the_file_row_and_key(tiny_model_dir, tmp_path, capsys):
    rows = my_rows()
    rows[4]["extra_info"]["answer"] = None
    data = write_table(rows, tmp_path / "gaps.parquet")
    argv = ["--model", str(tiny_model_dir), "--data", data, "--out", str(tmp_path / "x")]
    assert sft_main([*argv, "--target-key", "extra_info.answer"]) == 1
    assert capsys.readouterr().err == (
        f"rlmesh sft: {data}, row 4, column 'extra_info.answer': no target (null or empty): "
        "every row needs one to train on\n"
    )
    assert not (tmp_path / "x").exists()  # refused before training
    assert sft_main([*argv, "--target-key", "extra_info.nope"]) == 1
    assert f"{data}, row 0, column 'extra_info.nope': no target" in capsys.readouterr().err
    assert sft_main([*argv, "--target-key", "solution"]) == 1
    err = capsys.readouterr().err
    assert (
        f"{data}, column 'solution': no column 'solution'" in err
        and "the file has: data_source, prompt" in err
    )
    rows[2]["reward_model"]["ground_truth"] = ""
    rows[3]["reward_model"] = None
    write_table(rows, data)
    assert sft_main(argv) == 1
    assert f"{data}, row 2, column 'reward_model.ground_truth': no target" in capsys.readouterr().err
    rows[2]["reward_model"]["ground_truth"] = "22"
    write_table(rows, data)
    assert sft_main(argv) == 1
    assert f"{data}, row 3, column 'reward_model.ground_truth': no target" in capsys.readouterr().err


def test_a_target_that_is_not_text_or_a_number_is_refused(tiny_model_dir, tmp_path):
    rows = my_rows()
    for i, row in enumerate(rows):
        row["extra_info"]["answer"] = [f"{i}"]
    data = write_table(rows, tmp_path / "lists.parquet")
    with pytest.raises(ValueError, match=r"row 0, column 'extra_info.answer': the target is a list"):
        sft_examples(data, load_tokenizer(tiny_model_dir), target_key="extra_info.answer")
    with pytest.raises(ValueError, match="has no"):
        sft_examples(data, load_tokenizer(tiny_model_dir), target_format="#### ")


def test_a_chat_template_file_replaces_the_tokenizers_own(tiny_model_dir, tmp_path, capsys):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    data = write_table(my_rows(), tmp_path / "mine.parquet")
    tok = load_tokenizer(tiny_model_dir, chat_template=template.read_text())
    assert tok.decode(sft_examples(data, tok)[1][0]) == "Q: echo 1\nA:"
    out = tmp_path / "sft"
    argv = ["--model", str(tiny_model_dir), "--data", data, "--out", str(out), "--epochs", "1"]
    assert sft_main([*argv, "--chat-template", str(template)]) == 0
    assert "sft: 6 examples" in capsys.readouterr().out
    # The output keeps the tokenizer's own template: RL takes the file through custom_chat_template.
    assert load_tokenizer(out).chat_template == load_tokenizer(tiny_model_dir).chat_template
    template.write_text("{% for m in messages %}")  # unclosed
    assert sft_main([*argv, "--chat-template", str(template)]) == 2
    assert "not a valid Jinja chat template" in capsys.readouterr().err


def test_dev_rows_of_a_data_source_without_a_built_in_reward_need_the_users_reward(
    tiny_model_dir, tmp_path, capsys
):
    data = write_table(my_rows(), tmp_path / "mine.parquet")
    argv = ["--model", str(tiny_model_dir), "--data", data, "--out", str(tmp_path / "sft"), "--epochs", "1",
            "--dev", data, "--eval-every", "1", "--max-new-tokens", "2"]  # fmt: skip
    assert sft_main(argv) == 2
    assert "data_source 'my_task'" in capsys.readouterr().err
    reward = tmp_path / "my_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0 if data_source == 'my_task' and extra_info['index'] >= 0 else 0.0, 'x': 2}\n"
    )
    assert sft_main([*argv, "--reward", str(reward), "--stop-at", "1.0"]) == 0
    assert "dev score 1.000 reached 1.0" in capsys.readouterr().out
    assert sft_main([*argv, "--reward", str(tmp_path / "nope.py")]) == 2
    assert "no such file" in capsys.readouterr().err
