import pytest

from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.runtime.launcher import ProcessLauncher


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen2 (saved with its tokenizer); its greedy output is varied enough to test."""
    out = tmp_path_factory.mktemp("tiny-model")
    return build_tiny_model(
        out, build_tokenizer(), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=1
    )


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory):
    """Same architecture, other weights: the target of weight pushes."""
    out = tmp_path_factory.mktemp("other-model")
    return build_tiny_model(
        out, build_tokenizer(), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=2
    )


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("engines"), stop_grace_s=20) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def engine(launcher, tiny_model_dir):
    return launcher.start_engine(tiny_model_dir, extra_args=["--max-batch-size", "16"])
