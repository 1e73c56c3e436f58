"""Every test here runs whole jobs: `make test-e2e` runs them all (about 15 minutes on 2 cores);
`make test` runs only those marked ``smoke``, so that it stays under 15 minutes."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent == HERE and not item.get_closest_marker("smoke"):
            item.add_marker(pytest.mark.e2e)
