import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.models.tiny import main


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_save_load_and_forward(tmp_path, tok):
    out = build_tiny_model(tmp_path / "m", tok, seed=3)
    assert (out / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    loaded_tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    cfg = model.config
    assert cfg.vocab_size == len(tok) == len(loaded_tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        128,
        2,
        4,
        2,
    )
    assert cfg.intermediate_size == 512 and cfg.max_position_embeddings == 1024 and cfg.tie_word_embeddings
    assert cfg.eos_token_id == cfg.pad_token_id == tok.eos_token_id
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    ids = torch.tensor([tok.encode("What is 1+2?")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_same_seed_same_weights(tmp_path, tok):
    a = load_file(build_tiny_model(tmp_path / "a", tok, seed=7) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", tok, seed=7) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", tok, seed=8) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_seed_leaves_global_rng_alone(tmp_path, tok):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", tok, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_llama_bf16_untied(tmp_path, tok):
    out = build_tiny_model(
        tmp_path / "l",
        tok,
        arch="llama",
        hidden_size=64,
        num_layers=1,
        dtype=torch.bfloat16,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.config.tie_word_embeddings
    assert load_file(out / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16


def test_unknown_arch(tmp_path, tok):
    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny_model(tmp_path, tok, arch="gpt9")


def test_module_main(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "cli"), "--hidden-size", "32", "--num-layers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors" in printed and "tokenizer.json" in printed
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "cli").config.hidden_size == 32
