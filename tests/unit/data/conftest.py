import pytest

from rlmesh.models import build_tokenizer


@pytest.fixture(scope="session")
def tok():
    return build_tokenizer()
