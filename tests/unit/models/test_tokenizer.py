import pytest
from transformers import AutoTokenizer

from rlmesh.models import build_tokenizer
from rlmesh.models.tokenizer import CHARS, SPECIAL_TOKENS

TEXTS = [
    "What is 12+7-3?",
    "  leading and trailing  ",
    "tabs\tare unknown but newlines\n\nare kept\n",
    "punctuation: a . b , c ' d !?",
    " ",
    "#### -16",
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


@pytest.mark.parametrize("text", [t for t in TEXTS if "\t" not in t])
def test_round_trip_exact(text):
    tok = build_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, nothing added
    assert tok.decode(ids) == text


def test_vocab_is_fixed():
    tok = build_tokenizer()
    assert len(tok) == len(CHARS) + len(SPECIAL_TOKENS) == 100
    assert tok.convert_tokens_to_ids("\n") == 0
    assert tok.convert_tokens_to_ids(" ") == 1
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id == 96
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [97, 98]
    assert build_tokenizer().get_vocab() == tok.get_vocab()


def test_unknown_char_and_special_tokens():
    tok = build_tokenizer()
    ids = tok.encode("a\tb<|im_end|>")
    assert ids == [66, tok.unk_token_id, 67, 98]
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_chat_template():
    tok = build_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 97 and ids.count(98) == 2
    assert tok.decode(ids) == text
    no_gen = tok.apply_chat_template(msgs[1:], add_generation_prompt=False, tokenize=False)
    assert no_gen == "<|im_start|>user\nWhat is 1+2?<|im_end|>\n"


def test_save_and_load(saved):
    tok = build_tokenizer()
    loaded = AutoTokenizer.from_pretrained(saved)
    assert loaded.get_vocab() == tok.get_vocab()
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == tok.decode(tok.encode(text))
    msgs = [{"role": "user", "content": "hi  there\n"}]
    assert loaded.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    ) == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert loaded.eos_token_id == loaded.pad_token_id == 96
    assert {"<|im_start|>", "<|im_end|>"} <= set(loaded.all_special_tokens)


def test_load_tokenizer_beside_a_qwen2_config_keeps_every_character(tmp_path):
    """transformers 5's AutoTokenizer would load Qwen2Tokenizer here (its byte-level regex drops
    the spaces of a char vocabulary); load_tokenizer must give back exactly what was saved."""
    from rlmesh.models import build_tiny_model, build_tokenizer, load_tokenizer

    model_dir = build_tiny_model(tmp_path / "m", build_tokenizer(), hidden_size=32, num_layers=1)
    tok = load_tokenizer(model_dir)
    text = "What is 12 + 7?\n#### 19"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.eos_token_id == build_tokenizer().eos_token_id


def test_load_tokenizer_pads_with_eos_when_the_tokenizer_has_no_pad_token(tmp_path):
    """Llama tokenizers ship without a pad token; the learner's batches need one. verl's
    hf_tokenizer pads with eos then, and so does load_tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlmesh.models import load_tokenizer

    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1, "a": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(
        tmp_path
    )
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token_id is None
    tok = load_tokenizer(tmp_path)
    assert tok.pad_token_id == tok.eos_token_id == 1
    assert tok.encode("a a", add_special_tokens=False) == [2, 2]


def test_words_are_whole_tokens_after_the_fixed_ids(tmp_path):
    words = ("user", "What", " is", "####")
    tok = build_tokenizer(tmp_path, words=words)
    assert len(tok) == 100 + len(words)
    assert tok.convert_tokens_to_ids(list(words)) == [100, 101, 102, 103]
    assert tok.convert_tokens_to_ids(["\n", "<|im_end|>"]) == [0, 98]  # the fixed ids stay
    text = "<|im_start|>user\nWhat is 12+7? #### 19<|im_end|>"
    ids = tok.encode(text)
    assert tok.convert_ids_to_tokens(ids)[:5] == ["<|im_start|>", "user", "\n", "What", " is"]
    assert (
        len(ids) == len(text) - sum(len(w) - 1 for w in words) - len("<|im_start|>") - len("<|im_end|>") + 2
    )
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nWhat is 12+7? #### 19"  # words are text
    from rlmesh.models.tokenizer import load_tokenizer

    assert load_tokenizer(tmp_path).encode(text) == ids


@pytest.mark.parametrize("words", [("a",), ("",), ("tab\there",), ("<|im_end|>",)])
def test_words_must_be_new_printable_strings(words):
    with pytest.raises(ValueError, match="words"):
        build_tokenizer(words=words)
