"""The service runtime against real gRPC servers on loopback."""

import asyncio
import json
import re
import signal
import subprocess
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.runtime.auth import client_auth_interceptors
from rlmesh.runtime.health import scrape_metrics
from rlmesh.runtime.server import CLIENT_GRPC_OPTIONS, GrpcService
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.support.polling import wait_until
from tests.support.processes import child_env, program
from tests.support.repo import REPO

TOKEN = "s3cret-token"


class CountingReward(reward_pb2_grpc.RewardServicer):
    async def Score(self, request, context):
        if not request.samples:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ScoreRequest.samples is empty")
        return reward_pb2.ScoreResponse(
            results=[
                reward_pb2.RewardResult(uid=s.uid, score=float(i)) for i, s in enumerate(request.samples)
            ]
        )


async def _start(token: str | None = None) -> GrpcService:
    service = GrpcService("reward", port=0, metrics_port=0, auth_token=token, shutdown_grace_s=5)
    service.add_servicer(reward_pb2_grpc.add_RewardServicer_to_server, CountingReward(), "rlmesh.v1.Reward")
    await service.start()
    return service


def _request(n: int = 2) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(samples=[reward_pb2.RewardSample(uid=f"u{i}") for i in range(n)])


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return reply.status


async def test_auth_refuses_missing_and_wrong_tokens_and_leaves_health_open():
    service = await _start(TOKEN)
    try:
        async with grpc.aio.insecure_channel(service.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await reward_pb2_grpc.RewardStub(ch).Score(_request(), timeout=5)
            assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "missing 'authorization: Bearer" in missing.value.details()
        async with grpc.aio.insecure_channel(
            service.address, interceptors=client_auth_interceptors("wrong")
        ) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await reward_pb2_grpc.RewardStub(ch).Score(_request(), timeout=5)
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "invalid bearer token" in wrong.value.details()
        async with grpc.aio.insecure_channel(
            service.address, interceptors=client_auth_interceptors(TOKEN)
        ) as ch:
            reply = await reward_pb2_grpc.RewardStub(ch).Score(_request(3), timeout=5)
            assert [r.score for r in reply.results] == [0.0, 1.0, 2.0]
        assert await _health(service.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await service.stop()


async def test_a_caller_without_the_token_never_has_its_request_parsed():
    # Bytes that are no ScoreRequest: parsed, they would fail as INTERNAL; refused unparsed, the
    # caller learns only that it is not authenticated.
    service = await _start(TOKEN)
    try:
        async with grpc.aio.insecure_channel(service.address) as ch:
            raw = ch.unary_unary("/rlmesh.v1.Reward/Score")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await raw(b"\xff\xff\xff not a protobuf", timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await service.stop()


async def test_bytes_that_are_not_the_request_message_get_invalid_argument_naming_it():
    service = await _start(TOKEN)
    try:
        async with grpc.aio.insecure_channel(
            service.address, interceptors=client_auth_interceptors(TOKEN)
        ) as ch:
            raw = ch.unary_unary("/rlmesh.v1.Reward/Score")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await raw(b"\xff\xff\xff not a protobuf", timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid rlmesh.v1.ScoreRequest" in refused.value.details()
            assert len((await reward_pb2_grpc.RewardStub(ch).Score(_request(2), timeout=5)).results) == 2
    finally:
        await service.stop()


async def test_requests_over_the_size_limit_are_refused_and_the_service_serves_on():
    service = GrpcService("reward", port=0, metrics_port=None, max_request_bytes=1024 * 1024)
    service.add_servicer(reward_pb2_grpc.add_RewardServicer_to_server, CountingReward(), "rlmesh.v1.Reward")
    await service.start()
    try:
        big = reward_pb2.ScoreRequest(
            samples=[reward_pb2.RewardSample(uid="u", response_text="x" * (2 * 1024 * 1024))]
        )
        async with grpc.aio.insecure_channel(service.address, options=CLIENT_GRPC_OPTIONS) as ch:
            stub = reward_pb2_grpc.RewardStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Score(big, timeout=5)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len((await stub.Score(_request(2), timeout=5)).results) == 2
    finally:
        await service.stop()


async def test_calls_past_the_concurrency_limit_are_refused_not_queued():
    entered, release = asyncio.Event(), asyncio.Event()

    class HeldReward(CountingReward):
        async def Score(self, request, context):
            entered.set()
            await release.wait()
            return await super().Score(request, context)

    service = GrpcService("reward", port=0, metrics_port=None, max_concurrent_rpcs=1)
    service.add_servicer(reward_pb2_grpc.add_RewardServicer_to_server, HeldReward(), "rlmesh.v1.Reward")
    await service.start()
    try:
        async with grpc.aio.insecure_channel(service.address) as ch:
            stub = reward_pb2_grpc.RewardStub(ch)
            first = asyncio.ensure_future(stub.Score(_request(1), timeout=30))
            await asyncio.wait_for(entered.wait(), 30)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Score(_request(1), timeout=5)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            release.set()
            assert len((await first).results) == 1
            assert len((await stub.Score(_request(1), timeout=5)).results) == 1
    finally:
        await service.stop()


async def test_without_token_configured_calls_need_no_auth():
    service = await _start(None)
    try:
        async with grpc.aio.insecure_channel(service.address) as ch:
            reply = await reward_pb2_grpc.RewardStub(ch).Score(_request(1), timeout=5)
        assert len(reply.results) == 1
    finally:
        await service.stop()


async def test_health_reports_serving_not_serving_and_unknown_services():
    service = await _start()
    try:
        assert await _health(service.address) == health_pb2.HealthCheckResponse.SERVING
        assert await _health(service.address, "rlmesh.v1.Reward") == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await _health(service.address, "rlmesh.v1.NoSuchService")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        await service.set_serving(False)
        assert await _health(service.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (
            await _health(service.address, "rlmesh.v1.Reward") == health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await service.set_serving(True)
        assert await _health(service.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await service.stop()


async def test_metrics_count_calls_errors_and_latency_per_method():
    service = await _start(TOKEN)
    try:
        async with grpc.aio.insecure_channel(
            service.address, interceptors=client_auth_interceptors(TOKEN)
        ) as ch:
            stub = reward_pb2_grpc.RewardStub(ch)
            for _ in range(3):
                await stub.Score(_request(), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Score(reward_pb2.ScoreRequest(), timeout=5)
        async with grpc.aio.insecure_channel(service.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await reward_pb2_grpc.RewardStub(ch).Score(_request(), timeout=5)
        text = await asyncio.to_thread(scrape_metrics, "127.0.0.1", service.metrics_port)
    finally:
        await service.stop()
    method = re.escape("/rlmesh.v1.Reward/Score")

    def value(metric: str, **labels: str) -> float:
        for line in text.splitlines():
            if line.startswith(metric + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{metric} {labels} not in /metrics")

    assert value("rlmesh_rpc_requests_total", method="/rlmesh.v1.Reward/Score", code="OK") == 3
    assert value("rlmesh_rpc_requests_total", method="/rlmesh.v1.Reward/Score", code="INVALID_ARGUMENT") == 1
    assert value("rlmesh_rpc_errors_total", method="/rlmesh.v1.Reward/Score", code="UNAUTHENTICATED") == 1
    assert value("rlmesh_rpc_latency_seconds_count", method="/rlmesh.v1.Reward/Score") == 5
    assert value("rlmesh_rpc_in_flight", method="/rlmesh.v1.Reward/Score") == 0
    assert re.search(rf'rlmesh_rpc_latency_seconds_bucket{{.*method="{method}".*}}', text)


def test_sigterm_during_a_slow_rpc_lets_it_finish_and_exits_zero(tmp_path):
    ready = tmp_path / "ready.json"
    release = tmp_path / "release"
    proc = subprocess.Popen(
        program("slow_reward", ready, 30),
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 60, "the server's ready file")
        assert proc.poll() is None, proc.stderr.read()
        info = json.loads(ready.read_text())
        result: dict[str, object] = {}

        def call() -> None:
            with grpc.insecure_channel(info["grpc_address"]) as ch:
                try:
                    req = reward_pb2.ScoreRequest(samples=[reward_pb2.RewardSample(uid=str(release))])
                    result["reply"] = reward_pb2_grpc.RewardStub(ch).Score(req, timeout=60)
                except grpc.RpcError as e:
                    result["error"] = e

        caller = threading.Thread(target=call)
        caller.start()

        def in_flight() -> bool:
            text = scrape_metrics("127.0.0.1", info["metrics_port"])
            return 'rlmesh_rpc_in_flight{method="/rlmesh.v1.Reward/Score",service="reward"} 1.0' in text

        wait_until(in_flight, 30, "the Score call to be in flight")
        proc.send_signal(signal.SIGTERM)
        release.touch()  # the in-flight call may finish now; the server must let it
        caller.join(timeout=60)
        assert "error" not in result, result.get("error")
        assert result["reply"].results[0].score == 1.0
        assert proc.wait(timeout=60) == 0
        logs = proc.stderr.read()
        assert '"msg": "stopping: draining in-flight RPCs"' in logs and '"msg": "stopped"' in logs
        assert '"service": "reward"' in logs and '"run_id": "test-run"' in logs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
