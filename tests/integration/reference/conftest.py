import pytest

from rlmesh.models import build_tiny_model, build_tokenizer


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen2 (char tokenizer, vocab 100, 256 positions) saved as safetensors."""
    out = tmp_path_factory.mktemp("tiny-ref")
    return build_tiny_model(
        out,
        build_tokenizer(),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=256,
        seed=3,
    )
