import torch
from transformers import AutoModelForCausalLM

from rlmesh.learner.checkpoints.hf_dir import write_hf_dir
from rlmesh.models import build_tiny_model, build_tokenizer


def test_sharded_hf_dir_loads_back(tmp_path):
    src = build_tiny_model(tmp_path / "src", build_tokenizer(), hidden_size=32, num_layers=2, seed=3)
    model = AutoModelForCausalLM.from_pretrained(src)
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    buckets = [named[:5], [], named[5:]]  # two shards (the empty bucket is another rank's share)
    out = write_hf_dir(tmp_path / "out", buckets, model.config, model.generation_config, str(src))
    assert (out / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in named:
        assert torch.equal(dict(loaded.named_parameters())[name], tensor), name
    assert (out / "tokenizer.json").is_file()
