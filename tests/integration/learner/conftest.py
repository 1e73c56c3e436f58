import pytest

from tests.support.learner import tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Qwen2, hidden size 32, saved with the char-level tokenizer."""
    return tiny_model(tmp_path_factory.mktemp("learner-tiny-model"))
