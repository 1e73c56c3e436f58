"""Property-based fuzzing of the gRPC services, as real processes (reward, reference, a rollout
replica with its engine, Redis): whatever a caller sends, a service answers OK or
INVALID_ARGUMENT naming a field or message of the request, never UNKNOWN/INTERNAL, and serves on.

Two kinds of input per method: messages drawn from the request's descriptor (every field's type,
edge values, unset fields) and raw bytes that may not be a message at all. Rollout's RPCs that
change the replica's state (pause, resume, drain) are not fuzzed here.

``make test`` runs a fixed, derandomized sample; ``make fuzz`` draws many more, at random."""

from __future__ import annotations

import re
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from rlmesh.job.stack import start_stack
from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.server import CLIENT_GRPC_OPTIONS
from rlmesh.v1 import common_pb2, reference_pb2, reward_pb2, rollout_pb2
from tests.support.protostrategies import FUZZ, build, message_dicts, names_in

RUN = f"fuzz-{uuid.uuid4().hex[:6]}"
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
# Where an accepted value costs real work, draws stay small (values past the caps stay in the mix).
# Token ids mostly inside the tiny vocabulary, so that draws get past the first check.
TOKEN_BOUNDS = {"prompt_ids": (-1, 120), "response_ids": (-1, 120), "stop_token_ids": (-1, 120)}
GENERATION_BOUNDS = {
    **TOKEN_BOUNDS,
    "n": (-2, 4),
    "max_new_tokens": (-2, 8),
    "min_new_tokens": (-2, 8),
    "top_k": (-2, 8),
}

# (service, method, request class, integer bounds)
METHODS = [
    ("reward", "rlmesh.v1.Reward/Score", reward_pb2.ScoreRequest, TOKEN_BOUNDS),
    ("reward", "rlmesh.v1.Reward/GetInfo", common_pb2.Empty, {}),
    ("reference", "rlmesh.v1.Reference/LogProbs", reference_pb2.LogProbsRequest, TOKEN_BOUNDS),
    ("reference", "rlmesh.v1.Reference/GetInfo", common_pb2.Empty, {}),
    ("rollout", "rlmesh.v1.Rollout/Generate", rollout_pb2.GenerateRequest, GENERATION_BOUNDS),
    ("rollout", "rlmesh.v1.Rollout/GetInfo", common_pb2.Empty, {}),
]


@pytest.fixture(scope="module")
def addresses(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("m"), build_tokenizer(), hidden_size=64, num_layers=2)
    with ProcessLauncher(tmp_path_factory.mktemp("fuzz-stack"), stop_grace_s=20) as launcher:
        overrides = [
            f"rlmesh.run_id={RUN}",
            f"actor_rollout_ref.model.path={model}",
            "rlmesh.log_format=text",
            "algorithm.use_kl_in_reward=true",
            "rlmesh.rollout.replicas=1",
        ]
        stack = start_stack(launcher, None, overrides, services=("reward", "reference", "rollout"), say=print)
        yield {
            "reward": stack.get("reward").grpc_address,
            "reference": stack.get("reference").grpc_address,
            "rollout": stack.rollouts[0].grpc_address,
        }


def call(address: str, method: str, payload: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address, options=CLIENT_GRPC_OPTIONS) as channel:
        try:
            channel.unary_unary(f"/{method}")(payload, timeout=60)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details() or ""


def check_answer(code: grpc.StatusCode, details: str, request_cls: type) -> None:
    assert code in ALLOWED, f"{code.name}: {details}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        named = [n for n in names_in(request_cls.DESCRIPTOR) if re.search(rf"\b{re.escape(n)}\b", details)]
        assert named, f"INVALID_ARGUMENT names no field or message of {request_cls.__name__}: {details!r}"


def serves_on(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# Lists that, left empty, stop a request at its first check: the "plausible" draws fill them.
NONEMPTY = frozenset({"inputs", "prompt_ids", "response_ids", "samples"})


@pytest.mark.parametrize("plausible", [False, True], ids=["any", "plausible"])
@pytest.mark.parametrize(("service", "method", "request_cls", "bounds"), METHODS, ids=[m[1] for m in METHODS])
def test_messages_drawn_from_the_descriptor_get_ok_or_invalid_argument(
    addresses, service, method, request_cls, bounds, plausible
):
    nonempty = NONEMPTY if plausible else frozenset()

    @FUZZ
    @given(values=message_dicts(request_cls.DESCRIPTOR, bounds, nonempty=nonempty))
    def fuzz(values):
        code, details = call(addresses[service], method, build(request_cls, values).SerializeToString())
        check_answer(code, details, request_cls)

    fuzz()
    serves_on(addresses[service])


@pytest.mark.parametrize(("service", "method", "request_cls", "bounds"), METHODS, ids=[m[1] for m in METHODS])
def test_arbitrary_bytes_get_ok_or_invalid_argument(addresses, service, method, request_cls, bounds):
    @FUZZ
    @given(payload=st.binary(max_size=300))
    def fuzz(payload):
        code, details = call(addresses[service], method, payload)
        check_answer(code, details, request_cls)

    fuzz()
    serves_on(addresses[service])
