"""The actor's weights as the learner hands them to a push: HF names, buckets, copies or not."""

import torch
from transformers import AutoModelForCausalLM

from rlmesh.learner.weight_sync.full_weights import iter_weight_buckets
from rlmesh.models import build_tiny_model, build_tokenizer


def test_buckets_cover_the_parameters_in_order_as_copies_or_as_the_parameters_themselves(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", build_tokenizer(), hidden_size=32, num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    bucket_bytes = 16 << 10

    copied = list(iter_weight_buckets(model, bucket_bytes, zero3=False, materialize=True))
    shared = list(iter_weight_buckets(model, bucket_bytes, zero3=False, materialize=True, copy=False))

    assert len(copied) == len(shared) > 1
    for copies, views in zip(copied, shared, strict=True):
        assert [n for n, _ in copies] == [n for n, _ in views]
        assert sum(t.numel() * t.element_size() for _, t in copies[:-1]) < bucket_bytes
    flat = [pair for bucket in shared for pair in bucket]
    assert [n for n, _ in flat] == list(params)  # named_parameters order, a tied weight once
    for (name, copy), (_, view) in zip((p for b in copied for p in b), flat, strict=True):
        assert torch.equal(copy, params[name]) and torch.equal(view, params[name])
        assert copy.data_ptr() != params[name].data_ptr()  # a push may hold it across a step
        assert view.data_ptr() == params[name].data_ptr()  # no copy: valid until the next bucket
        assert not view.requires_grad

    assert all(b == [] for b in iter_weight_buckets(model, bucket_bytes, zero3=False, materialize=False))
