import logging
from types import SimpleNamespace

import pyarrow as pa
import pytest

from rlmesh.data import DatasetError, RLHFDataset
from rlmesh.data.dataset import truncate_ids
from tests.support.data import row, write

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def test_message_list_prompts_get_the_chat_template(tmp_path, tok):
    f = write(tmp_path / "a.parquet", [row("What is 1+2?", gt="3"), row("hi", gt="x")])
    ds = RLHFDataset(f, tok)
    assert len(ds) == 2
    item = ds[0]
    assert item.prompt_text == CHAT.format("What is 1+2?")
    assert item.prompt_ids == tok(item.prompt_text, add_special_tokens=False)["input_ids"]
    assert (item.index, item.row, item.file) == (0, 0, str(f))
    assert (item.ground_truth, item.data_source, item.ability, item.extra_info) == (
        "3",
        "test/src",
        "math",
        {"index": 0},
    )
    assert item.raw_prompt == [{"role": "user", "content": "What is 1+2?"}]


def test_string_prompts_are_plain_text(tmp_path, tok):
    rows = [{"data_source": "s", "prompt": "Q: 2+2=", "reward_model": {"ground_truth": "4"}}]
    ds = RLHFDataset(write(tmp_path / "s.parquet", rows), tok)
    assert ds[0].prompt_text == "Q: 2+2=" and tok.decode(ds[0].prompt_ids) == "Q: 2+2="
    assert ds[0].ability == "" and ds[0].extra_info == {}


def test_no_chat_template_joins_contents(tmp_path, tok):
    tok2 = tok.__class__(tokenizer_object=tok.backend_tokenizer, eos_token="<|endoftext|>")
    assert not tok2.chat_template
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    ds = RLHFDataset(write(tmp_path / "a.parquet", [row(msgs)]), tok2)
    assert ds[0].prompt_text == "S\nU"


def test_prompt_key_and_several_files(tmp_path, tok):
    a = write(tmp_path / "a.parquet", [row("x", question=[{"role": "user", "content": "first"}])])
    b = write(tmp_path / "b.parquet", [row("y", question=[{"role": "user", "content": "second"}])] * 2)
    ds = RLHFDataset([a, b], tok, prompt_key="question")
    assert [i.prompt_text for i in ds] == [CHAT.format("first")] + [CHAT.format("second")] * 2
    assert [(i.index, i.row, i.file) for i in ds] == [(0, 0, str(a)), (1, 0, str(b)), (2, 1, str(b))]


def test_max_samples(tmp_path, tok):
    a = write(tmp_path / "a.parquet", [row(str(i)) for i in range(3)])
    b = write(tmp_path / "b.parquet", [row(str(i)) for i in range(3, 6)])
    assert [i.raw_prompt[0]["content"] for i in RLHFDataset([a, b], tok, max_samples=4)] == list("0123")


def _long(tmp_path, tok):
    # The template adds 19 tokens; content is 26 letters, so the prompt is 45 tokens.
    f = write(tmp_path / "l.parquet", [row("ab"), row("abcdefghijklmnopqrstuvwxyz")])
    full = tok(CHAT.format("abcdefghijklmnopqrstuvwxyz"), add_special_tokens=False)["input_ids"]
    return f, full


def test_truncation_left_keeps_the_end(tmp_path, tok):
    f, full = _long(tmp_path, tok)
    ds = RLHFDataset(f, tok, max_prompt_length=30, truncation="left")
    assert ds[1].prompt_ids == full[-30:] and ds.num_truncated == 1
    assert ds[1].prompt_text.endswith("<|im_start|>assistant\n") and len(ds[1].prompt_text) < len(CHAT) + 26


def test_truncation_right_keeps_the_start(tmp_path, tok):
    f, full = _long(tmp_path, tok)
    ds = RLHFDataset(f, tok, max_prompt_length=30, truncation="right")
    assert ds[1].prompt_ids == full[:30]
    assert ds[1].prompt_text == tok.decode(full[:30]) and ds[1].prompt_text.startswith(
        "<|im_start|>user\nabc"
    )


def test_truncation_middle_keeps_both_ends(tmp_path, tok):
    f, full = _long(tmp_path, tok)
    ds = RLHFDataset(f, tok, max_prompt_length=31, truncation="middle")
    assert ds[1].prompt_ids == full[:15] + full[-16:]
    assert (
        ds[0].prompt_ids == tok(CHAT.format("ab"), add_special_tokens=False)["input_ids"]
    )  # short: untouched


def test_truncate_ids():
    ids = list(range(10))
    assert truncate_ids(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate_ids(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate_ids(ids, 5, "middle") == [0, 1, 7, 8, 9]
    assert truncate_ids(ids, 10, "error") == ids


def test_truncation_error_names_row_and_length(tmp_path, tok):
    f, full = _long(tmp_path, tok)
    with pytest.raises(DatasetError) as e:
        RLHFDataset(f, tok, max_prompt_length=30)
    msg = str(e.value)
    assert str(f) in msg and "row 1" in msg and "'prompt'" in msg
    assert f"{len(full)} tokens" in msg and "max_prompt_length=30" in msg
    assert (e.value.row, e.value.column) == (1, "prompt")


def _overlong(tmp_path, name, count, long_rows):
    rows = [row("x" * (40 + i) if i in long_rows else "ab") for i in range(count)]
    return write(tmp_path / name, rows)


def test_truncation_error_counts_every_overlong_row(tmp_path, tok):
    f = _overlong(tmp_path, "many.parquet", 12, long_rows={2, 3, 5, 8, 9, 11})
    e = _err(lambda: RLHFDataset(f, tok, max_prompt_length=30))
    msg = str(e)
    # Every row is counted, a few are named, and the longest (row 11: 19 + 51 tokens).
    assert msg.startswith(
        f"{f}, column 'prompt': 6 of 12 prompts are longer than max_prompt_length=30 tokens: "
    )
    assert (
        "row 2 (61 tokens), row 3 (62 tokens), row 5 (64 tokens), row 8 (67 tokens), row 9 (68 tokens)" in msg
    )
    assert "and 1 more; the longest is row 11 (70 tokens)" in msg
    assert "set truncation to left, right or middle, or set filter_overlong_prompts=true" in msg
    assert (e.file, e.row, e.column) == (str(f), None, "prompt")  # several rows: none is the row


def test_overlong_message_uses_the_callers_setting_names(tmp_path, tok):
    f = _overlong(tmp_path, "one.parquet", 3, long_rows={1})
    e = _err(
        lambda: RLHFDataset(
            f, tok, max_prompt_length=30, setting_names={"max_prompt_length": "--max-prompt-length"}
        )
    )
    assert "longer than --max-prompt-length=30 tokens: row 1 (60 tokens)" in str(e)
    assert "Raise --max-prompt-length, set truncation to" in str(e)
    # A command line without truncation or filtering: its one remedy.
    names = {"max_prompt_length": "--max-prompt-length", "truncation": "", "filter_overlong_prompts": ""}
    e = _err(lambda: RLHFDataset(f, tok, max_prompt_length=30, setting_names=names))
    assert str(e).endswith("row 1 (60 tokens). Raise --max-prompt-length")
    # from_config: verl's full key names.
    e = _err(lambda: RLHFDataset.from_config({"train_files": str(f), "max_prompt_length": 30}, tok))
    assert "longer than data.max_prompt_length=30 tokens" in str(e)
    assert "set data.truncation to left, right or middle, or set data.filter_overlong_prompts=true" in str(e)
    e = _err(lambda: RLHFDataset.from_config({"train_files": str(f), "max_prompt_length": 5,
                                              "filter_overlong_prompts": True}, tok))  # fmt: skip
    assert "all 3 prompts are longer than data.max_prompt_length=5" in str(e)
    assert "(data.filter_overlong_prompts)" in str(e)


def test_overlong_rows_in_several_files_name_their_file(tmp_path, tok):
    a = _overlong(tmp_path, "a.parquet", 3, long_rows={0})
    b = _overlong(tmp_path, "b.parquet", 3, long_rows={2})
    e = _err(lambda: RLHFDataset([a, b], tok, max_prompt_length=30))
    assert str(e).startswith(
        f"column 'prompt': 2 of 6 prompts are longer than max_prompt_length=30 tokens: {a} row 0 (59 tokens), "
        f"{b} row 2 (61 tokens)"
    )
    assert e.file is None


def test_truncated_prompts_are_counted_and_summarised(tmp_path, tok, caplog):
    f = _overlong(tmp_path, "cut.parquet", 4, long_rows={1, 3})
    with caplog.at_level(logging.INFO, logger="rlmesh.data.dataset"):
        ds = RLHFDataset.from_config(
            {"train_files": str(f), "max_prompt_length": 30, "truncation": "right"}, tok
        )
    assert len(ds) == 4 and ds.num_truncated == 2
    assert [(o.row, o.tokens) for o in ds.overlong] == [(1, 60), (3, 62)]
    summary = "2 of 4 prompts are longer than data.max_prompt_length=30 tokens: row 1 (60 tokens), row 3 (62 tokens)"
    assert ds.overlong_summary() == summary
    assert any(
        summary in r.getMessage() and "data.truncation=right" in r.getMessage() for r in caplog.records
    )


def test_filter_overlong_prompts(tmp_path, tok, caplog):
    rows = [row("ab"), row("x" * 40), row("cd"), row("y" * 50)]
    f = write(tmp_path / "f.parquet", rows)
    with caplog.at_level(logging.INFO, logger="rlmesh.data.dataset"):
        ds = RLHFDataset(f, tok, max_prompt_length=30, filter_overlong_prompts=True, truncation="error")
    assert ds.num_filtered == 2 and ds.num_rows == 4 and len(ds) == 2
    assert [(i.index, i.row) for i in ds] == [(0, 0), (1, 2)]
    assert any("filtered out 2 of 4" in r.getMessage() for r in caplog.records)
    # Exactly at the limit is kept (verl: length <= max_prompt_length).
    assert len(RLHFDataset(f, tok, max_prompt_length=21, filter_overlong_prompts=True)) == 2
    with pytest.raises(DatasetError, match="all 4 prompts are longer"):
        RLHFDataset(f, tok, max_prompt_length=5, filter_overlong_prompts=True)


def test_from_config(tmp_path, tok):
    tr = write(tmp_path / "train.parquet", [row("a"), row("bbbbbbbbbbbbbbbbbbbb")])
    va = write(tmp_path / "val.parquet", [row("v")])
    cfg = SimpleNamespace(
        train_files=[str(tr)], val_files=str(va), prompt_key="prompt", max_prompt_length=25, truncation="left",
        filter_overlong_prompts=True, shuffle=True, seed=1, train_batch_size=1, val_batch_size=None,
    )  # fmt: skip
    train = RLHFDataset.from_config(cfg, tok)
    assert len(train) == 1 and train.num_filtered == 1
    val = RLHFDataset.from_config(cfg, tok, split="val")
    assert [i.raw_prompt[0]["content"] for i in val] == ["v"]
    as_dict = {"train_files": str(tr), "max_prompt_length": 25, "truncation": "left"}
    assert len(RLHFDataset.from_config(as_dict, tok)) == 2
    with pytest.raises(DatasetError, match="val_files is not set"):
        RLHFDataset.from_config({"train_files": str(tr)}, tok, split="val")


# ---- bad input: every error names the file, the row and the column ------------------------------


def _err(fn):
    with pytest.raises(DatasetError) as e:
        fn()
    assert not isinstance(e.value, KeyError)
    return e.value


@pytest.mark.parametrize("column", ["prompt", "data_source", "reward_model"])
def test_missing_column(tmp_path, tok, column):
    r = row("a")
    del r[column]
    f = write(tmp_path / "m.parquet", [r])
    e = _err(lambda: RLHFDataset(f, tok))
    assert str(f) in str(e) and repr(column) in str(e) and "missing column" in str(e)


def test_missing_prompt_key_column(tmp_path, tok):
    f = write(tmp_path / "m.parquet", [row("a")])
    e = _err(lambda: RLHFDataset(f, tok, prompt_key="question"))
    assert "'question'" in str(e) and "data_source, prompt" in str(e)


def test_unreadable_and_non_parquet_files(tmp_path, tok):
    missing = tmp_path / "nope.parquet"
    assert str(missing) in str(_err(lambda: RLHFDataset(missing, tok)))
    junk = tmp_path / "junk.parquet"
    junk.write_text("this is not parquet\n")
    e = _err(lambda: RLHFDataset(junk, tok))
    assert str(junk) in str(e) and "Parquet" in str(e)
    folder = tmp_path / "dir"
    folder.mkdir()
    assert str(folder) in str(_err(lambda: RLHFDataset(folder, tok)))


def test_empty_dataset(tmp_path, tok):
    schema = pa.Table.from_pylist([row("a")]).schema
    f = write(tmp_path / "empty.parquet", [], schema=schema)
    e = _err(lambda: RLHFDataset(f, tok))
    assert str(f) in str(e) and "no rows" in str(e)
    with pytest.raises(DatasetError, match="no data files"):
        RLHFDataset([], tok)


@pytest.mark.parametrize(
    ("bad", "column", "words"),
    [
        ({"prompt": None}, "prompt", "got NoneType"),
        ({"prompt": ""}, "prompt", "empty prompt"),
        ({"prompt": []}, "prompt", "empty message list"),
        ({"prompt": [{"role": "user", "content": None}]}, "prompt", "message 0"),
        ({"data_source": None}, "data_source", "expected a string"),
        ({"reward_model": None}, "reward_model.ground_truth", "missing ground truth"),
        (
            {"reward_model": {"style": "rule", "ground_truth": None}},
            "reward_model.ground_truth",
            "missing ground truth",
        ),
    ],
)
def test_bad_row(tmp_path, tok, bad, column, words):
    good = row("fine")
    rows = [good, good, {**good, **bad}]
    if isinstance(bad.get("prompt"), str):  # a string column needs every row to be a string
        rows = [{**r, "prompt": "fine"} for r in rows[:2]] + [rows[2]]
    f = write(tmp_path / "bad.parquet", rows)
    e = _err(lambda: RLHFDataset(f, tok))
    assert str(f) in str(e) and "row 2" in str(e) and repr(column) in str(e) and words in str(e)
    assert (e.file, e.row, e.column) == (str(f), 2, column)


def test_wrong_column_types(tmp_path, tok):
    f = write(tmp_path / "t.parquet", [row("a", ability=5)])
    e = _err(lambda: RLHFDataset(f, tok))
    assert "row 0" in str(e) and "'ability'" in str(e)
    f = write(tmp_path / "p.parquet", [row(7)])
    e = _err(lambda: RLHFDataset(f, tok))
    assert "row 0" in str(e) and "'prompt'" in str(e) and "got int" in str(e)
    f = write(tmp_path / "e.parquet", [row("a", extra_info="oops")])
    assert "'extra_info'" in str(_err(lambda: RLHFDataset(f, tok)))


def test_ground_truth_optional_when_not_required(tmp_path, tok):
    r = row("a")
    del r["reward_model"]
    ds = RLHFDataset(write(tmp_path / "n.parquet", [r]), tok, require_ground_truth=False)
    assert ds[0].ground_truth is None


def test_bad_arguments(tmp_path, tok):
    f = write(tmp_path / "a.parquet", [row("a")])
    with pytest.raises(ValueError, match="truncation"):
        RLHFDataset(f, tok, truncation="sideways")
