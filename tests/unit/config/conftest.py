from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def write_yaml(tmp_path: Path) -> Callable[[str], Path]:
    """Writes YAML text to a fresh file under tmp_path and returns its path."""
    count = 0

    def write(text: str) -> Path:
        nonlocal count
        count += 1
        path = tmp_path / f"config_{count}.yaml"
        path.write_text(text)
        return path

    return write


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # A token in the developer's shell must not leak into configs under test.
    monkeypatch.delenv("RLMESH_AUTH_TOKEN", raising=False)
