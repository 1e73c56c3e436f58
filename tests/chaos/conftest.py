import pytest

from tests.support.jobs import Files, make_files


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    return make_files(tmp_path_factory.mktemp("chaos"))
