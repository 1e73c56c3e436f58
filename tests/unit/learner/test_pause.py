"""What a paused learner says over its real ``GetStatus`` (gRPC on loopback): who paused it
(rlmesh.learner.start_paused, or a Pause request from the control plane) and how it goes on, not
that it waits for replicas; and nothing once resumed. The loop's holds (``wait_for_replicas``,
``hold_while_paused``) run on a stand-in that has the state and the replica lookup they use."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rlmesh.learner.run.loop_state import (
    PAUSE_REQUEST,
    START_PAUSED,
    LoopState,
    hold_while_paused,
    wait_for_replicas,
)
from rlmesh.learner.run.servicer import LearnerServicer
from rlmesh.v1 import common_pb2, learner_pb2, learner_pb2_grpc
from tests.support.polling import eventually

NO_REPLICA = "no rollout replica registered yet"


class Loop:
    """What the holds and the servicer touch of a TrainingLoop."""

    def __init__(self, state: LoopState) -> None:
        self.state = state
        self.keys = type("Keys", (), {"run_id": "r"})()
        self.replicas: list[object] = []  # what the registry lists: none until a test adds one

    def current_hparams(self) -> dict[str, float]:
        return {}

    async def live_engines(self) -> list[object]:
        return self.replicas

    async def checkpoint(self, step: int) -> str:
        raise AssertionError("no checkpoint was requested")


@pytest.fixture
async def serve():
    servers = []

    async def start(loop: Loop) -> learner_pb2_grpc.LearnerStub:
        server = grpc.aio.server()
        learner_pb2_grpc.add_LearnerServicer_to_server(LearnerServicer(loop), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        servers.append((server, channel))
        return learner_pb2_grpc.LearnerStub(channel)

    yield start
    for server, channel in servers:
        await channel.close()
        await server.stop(None)


def said(stub: learner_pb2_grpc.LearnerStub):
    async def read() -> tuple[str, str]:
        st = await stub.GetStatus(common_pb2.Empty())
        return learner_pb2.LearnerPhase.Name(st.phase).removeprefix("LEARNER_PHASE_"), st.message

    return read


async def test_a_learner_started_paused_says_so_while_no_replica_is_there_yet(serve):
    loop = Loop(LoopState(paused=True, paused_by=START_PAUSED))
    stub = await serve(loop)
    waiting = asyncio.create_task(wait_for_replicas(loop.state, loop.live_engines))
    await eventually(said(stub), ("PAUSED", loop.state.paused_message), "the start pause")
    assert loop.state.paused_message.startswith("paused since start (rlmesh.learner.start_paused=true)")
    await stub.Resume(common_pb2.Empty())  # resumed, and still no replica: that is what holds it now
    await eventually(said(stub), ("PUSHING_WEIGHTS", NO_REPLICA), "the wait for replicas")
    loop.replicas.append(object())
    await asyncio.wait_for(waiting, 30)
    assert await said(stub)() == ("PUSHING_WEIGHTS", "")


async def test_a_pause_request_is_named_as_such_and_resume_clears_it(serve):
    loop = Loop(LoopState(paused=True, paused_by=START_PAUSED))
    stub = await serve(loop)
    await stub.Resume(common_pb2.Empty())
    assert (loop.state.paused, loop.state.paused_by) == (False, "")
    await stub.Pause(common_pb2.Empty())  # what the control plane sends for `rlmesh ctl pause`
    assert loop.state.paused_by == PAUSE_REQUEST
    holding = asyncio.create_task(hold_while_paused(loop.state, loop.checkpoint))
    await eventually(said(stub), ("PAUSED", loop.state.paused_message), "the requested pause")
    assert loop.state.paused_message.startswith("paused from the control plane (rlmesh ctl pause)")
    await stub.Resume(common_pb2.Empty())
    await asyncio.wait_for(holding, 30)
    assert (await said(stub)())[1] == ""
