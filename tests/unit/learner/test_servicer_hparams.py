"""The learner's ``UpdateHyperparams`` over a real gRPC server on loopback: it takes the control
plane's ranges (one table, rlmesh.config.hparams.HPARAMS), refusing a value past either end with
INVALID_ARGUMENT naming the field and its range, and keeps nothing of a refused request. The
training loop behind it is a stand-in holding the state the RPC reads and writes."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from rlmesh.config.hparams import HPARAMS, range_text
from rlmesh.learner.run.loop_state import LoopState
from rlmesh.learner.run.servicer import LearnerServicer
from rlmesh.v1 import learner_pb2, learner_pb2_grpc


class Loop:
    """What the servicer touches of a TrainingLoop: its state, its critic, the values in force."""

    def __init__(self) -> None:
        self.state = LoopState()
        self.trainer = SimpleNamespace(critic=object())

    def current_hparams(self) -> dict[str, float]:
        return dict(self.state.pending_hparams)


@pytest.fixture
async def learner():
    loop = Loop()
    server = grpc.aio.server()
    learner_pb2_grpc.add_LearnerServicer_to_server(LearnerServicer(loop), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield loop, learner_pb2_grpc.LearnerStub(channel)
    await server.stop(None)


def past_the_ends(h):
    return [h.low - 1, h.high * 1.5, h.high + 1e9, *([h.low] if h.low_open else [])]


@pytest.mark.parametrize("h", list(HPARAMS.values()), ids=list(HPARAMS))
async def test_a_value_outside_the_control_planes_range_is_refused(learner, h):
    loop, stub = learner
    for value in [*past_the_ends(h), float("nan"), float("inf")]:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.UpdateHyperparams(learner_pb2.UpdateHyperparamsRequest(**{h.name: value}))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details()
        assert details.startswith(f"{h.name}={value}: ") and range_text(h) in details and h.key in details
    assert loop.state.pending_hparams == {}


async def test_values_at_the_ends_are_taken(learner):
    loop, stub = learner
    for h in HPARAMS.values():
        for value in (h.high, *([] if h.low_open else [h.low])):
            answer = await stub.UpdateHyperparams(learner_pb2.UpdateHyperparamsRequest(**{h.name: value}))
            assert answer.values[h.key] == value
            assert loop.state.pending_hparams[h.name] == value


async def test_one_bad_field_refuses_the_whole_request(learner):
    loop, stub = learner
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.UpdateHyperparams(learner_pb2.UpdateHyperparamsRequest(kl_coef=0.1, actor_lr=1e9))
    assert refused.value.details().startswith("actor_lr=1000000000.0: must be a finite number in (0, 1]")
    assert loop.state.pending_hparams == {}
