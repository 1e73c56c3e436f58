"""BalancedCaller against real gRPC servers on loopback: retries on the next address, and what it
raises once its attempts are spent."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.runtime.balancer import BalancedCaller, ServiceCallError
from rlmesh.runtime.net import free_port
from rlmesh.runtime.server import GrpcService


@pytest.fixture
async def serving():
    service = GrpcService("health-only", port=0, metrics_port=None, shutdown_grace_s=1)
    await service.start()
    yield service
    await service.stop()


def dead_address() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


async def test_a_call_that_finds_an_address_down_succeeds_on_the_next(serving):
    dead = dead_address()
    caller = BalancedCaller(
        "health", health_pb2_grpc.HealthStub, [dead, serving.address], timeout_s=5, backoff_s=0.01
    )
    try:
        reply = await caller.call("Check", health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await caller.close()


async def test_attempts_spent_raise_the_last_status_naming_every_address_tried():
    dead = dead_address()
    caller = BalancedCaller(
        "health", health_pb2_grpc.HealthStub, [dead], timeout_s=5, max_attempts=3, backoff_s=0.01
    )
    try:
        with pytest.raises(ServiceCallError) as err:
            await caller.call("Check", health_pb2.HealthCheckRequest())
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert err.value.tried == [dead, dead, dead]
    finally:
        await caller.close()


async def test_a_status_not_worth_retrying_is_raised_after_one_attempt(serving):
    caller = BalancedCaller("health", health_pb2_grpc.HealthStub, [serving.address], timeout_s=5)
    try:
        with pytest.raises(ServiceCallError) as err:  # health knows no such service: NOT_FOUND
            await caller.call("Check", health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert err.value.tried == [serving.address]
    finally:
        await caller.close()
