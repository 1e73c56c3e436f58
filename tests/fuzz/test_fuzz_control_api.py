"""Schemathesis against the control plane's own OpenAPI schema, a real ``rlmesh serve control`` in
front of a real learner service: whatever a caller sends any route, valid for the schema or not,
the answer is never a 5xx.

One test per operation, each with its own draws and its own timeout: drawn from the whole schema
at once, a route without parameters has a single distinct request and got one draw, those with
parameters got all the rest, and ``make fuzz`` drew 25,000 cases in one test, past its 300 s
timeout on two slow cores. The draws share one keep-alive HTTP session.

Not fuzzed: ``POST /api/v1/run/stop`` (it ends the learner the other routes talk to; the
integration tests stop it) and ``POST``/``PUT /api/v1/rewards`` (they dial the addresses they are
given to check their health; a drawn host name would be looked up beyond loopback). The cases come
from the schema's Hypothesis strategies (schemathesis's pytest plugin is not used: its
fixture-based loader does not run under this pytest)."""

from __future__ import annotations

import os

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from rlmesh.runtime.launcher import ProcessLauncher
from tests.support.control import AUTH, start_control_stack

NOT_FUZZED = {"POST /api/v1/run/stop", "POST /api/v1/rewards", "PUT /api/v1/rewards"}
# Every other operation of the schema (test_every_operation_is_fuzzed holds the two lists to it).
OPERATIONS = (
    "GET /health",
    "GET /metrics",
    "GET /api/v1/run/status",
    "GET /api/v1/run/metrics",
    "GET /api/v1/run/metrics/keys",
    "GET /api/v1/run/validation",
    "GET /api/v1/run/config",
    "POST /api/v1/run/pause",
    "POST /api/v1/run/resume",
    "POST /api/v1/run/checkpoint",
    "GET /api/v1/hyperparams",
    "PATCH /api/v1/hyperparams",
    "GET /api/v1/audit",
    "GET /api/v1/replicas",
    "POST /api/v1/replicas/{replica_id}/drain",
    "DELETE /api/v1/replicas/{replica_id}",
    "GET /api/v1/rewards",
    "DELETE /api/v1/rewards/{address}",
    "GET /api/v1/queues",
    "GET /api/v1/dead-letters",
    "POST /api/v1/dead-letters/{dead_letter_id}/replay",
    "GET /api/v1/alerts",
    "GET /api/v1/auto",
    "GET /api/v1/autoscale",
    "POST /api/v1/alerts/webhook",
)

# Per operation: the same 20 draws every run; `make fuzz` (FUZZ_EXAMPLES=1000): that many, at
# random. One without parameters has a single request to draw: Hypothesis stops after it.
_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))
EXAMPLES = _EXAMPLES or 20


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("control"), stop_grace_s=10) as launcher:
        stack = start_control_stack(launcher, tmp_path_factory.mktemp("files"))
        schema = schemathesis.openapi.from_url(f"{stack.url}/openapi.json", headers=AUTH)
        with requests.Session() as session:
            yield stack, schema, session


def test_every_operation_is_fuzzed(control):
    _, schema, _ = control
    served = {result.ok().label for result in schema.get_all_operations()}
    assert served == set(OPERATIONS) | NOT_FUZZED


@pytest.mark.parametrize("operation", OPERATIONS)
def test_no_input_makes_the_control_plane_fail(control, operation):
    stack, schema, session = control
    method, path = operation.split(" ", 1)
    api_operation = schema[path][method]
    cases = st.one_of(
        api_operation.as_strategy(GenerationMode.POSITIVE),
        api_operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @given(case=cases)
    @settings(
        max_examples=EXAMPLES,
        derandomize=not _EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def check(case):
        response = case.call(base_url=stack.url, session=session, headers=AUTH)
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
        )

    check()
