"""Every test here runs whole jobs: `make test` runs them with the rest, in two lanes of its
pytest-xdist workers (tests/conftest.py); `make test-e2e` runs them alone."""

from pathlib import Path

import pytest

from tests.support.stack import Prepared, prepare_model_and_data

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent == HERE:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Prepared:
    """The warmed-up model and its data that the learner-service tests train from (read only):
    one supervised warm-up a worker, not one a module."""
    return prepare_model_and_data(tmp_path_factory.mktemp("prep"))
