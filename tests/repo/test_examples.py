"""The example configs: the CPU demo's is the one the package ships (``rlmesh demo`` runs that one),
and every example is a valid configuration."""

from __future__ import annotations

import pytest

from rlmesh.config import load_config
from rlmesh.job import demo
from tests.support.repo import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_the_cpu_demo_example_is_the_packaged_config():
    example = REPO / "examples" / "cpu_demo.yaml"
    assert demo.DEMO_CONFIG == REPO / "libs" / "rlmesh" / "job" / "cpu_demo.yaml"
    assert example.read_text() == demo.DEMO_CONFIG.read_text(), (
        "examples/cpu_demo.yaml differs from libs/rlmesh/job/cpu_demo.yaml (what `rlmesh demo` runs); "
        "make it a link: ln -sf ../libs/rlmesh/job/cpu_demo.yaml examples/cpu_demo.yaml"
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_is_valid(example):
    load_config(example)
