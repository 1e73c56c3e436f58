"""Schemathesis against the control plane's own OpenAPI schema, a real ``rlmesh serve control`` in
front of a real learner service: whatever a caller sends any route, valid for the schema or not,
the answer is never a 5xx.

Not fuzzed: ``POST /api/v1/run/stop`` (it ends the learner the other routes talk to; the
integration tests stop it) and ``POST``/``PUT /api/v1/rewards`` (they dial the addresses they are
given to check their health; a drawn host name would be looked up beyond loopback). The cases come
from the schema's Hypothesis strategies (schemathesis's pytest plugin is not used: its
fixture-based loader does not run under this pytest)."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from rlmesh.runtime.launcher import ProcessLauncher
from tests.support.control import AUTH, start_control_stack

# Over every operation together: about a dozen each, in a few seconds, the same draws every run;
# `make fuzz` (FUZZ_EXAMPLES=1000): about that many per operation, at random.
_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))
EXAMPLES = _EXAMPLES * 25 or 300


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("control"), stop_grace_s=10) as launcher:
        stack = start_control_stack(launcher, tmp_path_factory.mktemp("files"))
        schema = (
            schemathesis.openapi.from_url(f"{stack.url}/openapi.json", headers=AUTH)
            .exclude(method="POST", path="/api/v1/run/stop")
            .exclude(method="POST", path="/api/v1/rewards")
            .exclude(method="PUT", path="/api/v1/rewards")
        )
        yield stack, schema


def test_no_input_makes_the_control_plane_fail(control):
    stack, schema = control
    cases = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE)
    )
    seen: set[str] = set()

    @given(case=cases)
    @settings(
        max_examples=EXAMPLES,
        derandomize=not _EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def check(case):
        seen.add(f"{case.method} {case.path}")
        response = case.call(base_url=stack.url, headers=AUTH)
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
        )

    check()
    assert len(seen) >= 15, sorted(seen)  # the draws reached most operations
