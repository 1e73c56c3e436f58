"""What a gRPC caller reaches with and without the token, against real servers on loopback: only
Health/Check is open; Health/Watch and reflection (off unless asked for) need the token; a flood of
idle streams without the token holds none of the server's concurrency slots; the metrics' method
label never takes a name a caller made up."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlmesh.config import ENV_AUTH_TOKEN
from rlmesh.runtime.auth import client_auth_interceptors
from rlmesh.runtime.health import scrape_metrics
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import reward_pb2, reward_pb2_grpc

TOKEN = "s3cret-token"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


class Reward(reward_pb2_grpc.RewardServicer):
    async def Score(self, request, context):
        return reward_pb2.ScoreResponse(results=[reward_pb2.RewardResult(uid=s.uid) for s in request.samples])


async def _start(token: str | None = TOKEN, **settings) -> GrpcService:
    settings = {"metrics_port": None, "shutdown_grace_s": 5, **settings}
    service = GrpcService("reward", port=0, auth_token=token, **settings)
    service.add_servicer(reward_pb2_grpc.add_RewardServicer_to_server, Reward(), "rlmesh.v1.Reward")
    await service.start()
    return service


def _channel(service: GrpcService, token: str | None = None) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(service.address, interceptors=client_auth_interceptors(token))


async def _score(channel: grpc.aio.Channel) -> int:
    request = reward_pb2.ScoreRequest(samples=[reward_pb2.RewardSample(uid="u")])
    return len((await reward_pb2_grpc.RewardStub(channel).Score(request, timeout=30)).results)


async def _list_services(channel: grpc.aio.Channel) -> list[str]:
    requests = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(requests, timeout=30)
    async for reply in call:
        return [s.name for s in reply.list_services_response.service]
    raise AssertionError("reflection answered nothing")


async def _refused_code(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return await call.code()


async def test_watch_needs_the_token_and_streams_every_change_of_health():
    service = await _start()
    try:
        async with _channel(service) as anonymous:
            watch = health_pb2_grpc.HealthStub(anonymous).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert await _refused_code(watch) == grpc.StatusCode.UNAUTHENTICATED
            # Check stays open: probes need no secret.
            reply = await health_pb2_grpc.HealthStub(anonymous).Check(health_pb2.HealthCheckRequest())
            assert reply.status == SERVING
        async with _channel(service, TOKEN) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            server = health.Watch(health_pb2.HealthCheckRequest(), timeout=60).__aiter__()
            reward = health.Watch(health_pb2.HealthCheckRequest(service="rlmesh.v1.Reward"), timeout=60)
            reward = reward.__aiter__()
            unknown = health.Watch(health_pb2.HealthCheckRequest(service="no.Such"), timeout=60).__aiter__()
            assert (await anext(server)).status == SERVING
            assert (await anext(reward)).status == SERVING
            assert (await anext(unknown)).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            await service.set_serving(False)
            assert (await anext(server)).status == NOT_SERVING
            assert (await anext(reward)).status == NOT_SERVING
            await service.set_serving(True)
            assert (await anext(server)).status == SERVING
    finally:
        await service.stop()


async def test_a_watch_ends_with_not_serving_when_the_service_stops_instead_of_holding_the_stop():
    # A grace period no test waits out: a Watch that held the stop would fail this test by timeout.
    service = await _start(shutdown_grace_s=3600)
    async with _channel(service, TOKEN) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
        statuses = watch.__aiter__()
        assert (await anext(statuses)).status == SERVING
        await asyncio.wait_for(service.stop(), 120)
        assert [reply.status async for reply in statuses] == [NOT_SERVING]
        assert await watch.code() == grpc.StatusCode.OK


async def test_reflection_is_off_by_default_and_behind_the_token_when_on():
    service = await _start()
    try:
        async with _channel(service, TOKEN) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as off:
                await _list_services(ch)
            assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await service.stop()
    service = await _start(reflection=True)
    try:
        for token in (None, "wrong"):
            async with _channel(service, token) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _list_services(ch)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with _channel(service, TOKEN) as ch:
            assert {"rlmesh.v1.Reward", "grpc.health.v1.Health"} <= set(await _list_services(ch))
    finally:
        await service.stop()


async def test_without_a_token_configured_reflection_when_on_and_watch_need_none():
    service = await _start(None, reflection=True)
    try:
        async with _channel(service) as ch:
            assert "rlmesh.v1.Reward" in await _list_services(ch)
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert (await anext(watch.__aiter__())).status == SERVING
            watch.cancel()
    finally:
        await service.stop()


async def test_a_flood_of_idle_streams_without_the_token_leaves_the_slots_to_callers_with_it():
    limit = 8
    service = await _start(max_concurrent_rpcs=limit, reflection=True, metrics_port=0)
    try:
        async with _channel(service) as anonymous, _channel(service, "wrong") as wrong:
            flood = []
            for ch in (anonymous, wrong):
                for _ in range(limit):
                    # Idle streams: reflection with no request sent, Watch as a stream that sends
                    # headers and no request (refused before reading), and plain Watch calls.
                    flood.append((REFLECTION, ch.stream_stream(REFLECTION)()))
                    flood.append((WATCH, ch.stream_stream(WATCH)()))
                    flood.append(
                        (WATCH, health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest()))
                    )
            codes = await asyncio.wait_for(asyncio.gather(*(_refused_code(call) for _, call in flood)), 120)
            # Each is refused for its missing token. gRPC counts a call against the limit from its
            # arrival, before the token is checked, so on a loaded machine more than `limit` of them
            # being refused at once can leave one refused for the limit instead: never let in.
            assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert codes.count(grpc.StatusCode.UNAUTHENTICATED) >= limit, codes
            # Once they are refused, none holds a slot: a caller with the token gets every one.
            async with _channel(service, TOKEN) as ch:
                assert [await _score(ch) for _ in range(limit + 1)] == [1] * (limit + 1)
        text = await asyncio.to_thread(scrape_metrics, "127.0.0.1", service.metrics_port)
    finally:
        await service.stop()
    # The token check counted each call it refused, by method.
    for method in (WATCH, REFLECTION):
        refused = sum(
            code == grpc.StatusCode.UNAUTHENTICATED
            for (m, _), code in zip(flood, codes, strict=True)
            if m == method
        )
        assert f'code="UNAUTHENTICATED",method="{method}",service="reward"}} {float(refused)}' in text


async def test_idle_watchers_with_the_token_do_hold_slots_which_is_why_watch_needs_it():
    # The flood above would take every slot if it were let in: here callers with the token do it.
    limit = 4
    service = await _start(max_concurrent_rpcs=limit)
    try:
        async with _channel(service, TOKEN) as ch:
            watchers = [
                health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest()) for _ in range(limit)
            ]
            for watch in watchers:
                assert (await anext(watch.__aiter__())).status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _score(ch)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for watch in watchers:
                watch.cancel()
    finally:
        await service.stop()


async def test_unknown_methods_are_refused_without_the_token_and_never_become_a_metric_label():
    service = await _start(metrics_port=0)
    try:
        async with _channel(service) as anonymous, _channel(service, TOKEN) as ch:
            for i in range(5):
                probe = anonymous.unary_unary(f"/made.Up/Probe{i}")
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await probe(b"", timeout=30)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await ch.unary_unary(f"/made.Up/Known{i}")(b"", timeout=30)
                assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert await _score(ch) == 1
        text = await asyncio.to_thread(scrape_metrics, "127.0.0.1", service.metrics_port)
    finally:
        await service.stop()
    assert "made.Up" not in text
    assert 'rlmesh_rpc_requests_total{code="UNAUTHENTICATED",method="unknown",service="reward"} 5.0' in text
    assert (
        'rlmesh_rpc_requests_total{code="OK",method="/rlmesh.v1.Reward/Score",service="reward"} 1.0' in text
    )


async def test_a_servicer_under_a_name_no_proto_declares_is_refused():
    service = GrpcService("reward", metrics_port=None)
    with pytest.raises(ValueError, match=r"no service 'rlmesh\.v1\.Rewards'"):
        service.add_servicer(reward_pb2_grpc.add_RewardServicer_to_server, Reward(), "rlmesh.v1.Rewards")


def test_a_service_process_serves_reflection_only_when_the_config_asks(tmp_path):
    async def services_listed(address: str) -> list[str] | grpc.StatusCode:
        async with grpc.aio.insecure_channel(address, interceptors=client_auth_interceptors(TOKEN)) as ch:
            try:
                return await _list_services(ch)
            except grpc.aio.AioRpcError as e:
                return e.code()

    common = [
        "rlmesh.run_id=exposure",
        "rlmesh.log_format=text",
        "rlmesh.reward.port=0",
        "rlmesh.reward.metrics_port=0",
    ]
    env = {ENV_AUTH_TOKEN: TOKEN}
    with ProcessLauncher(tmp_path, stop_grace_s=10) as launcher:
        default = launcher.start_service("reward", name="reward-default", overrides=common, env=env)
        assert asyncio.run(services_listed(default.grpc_address)) == grpc.StatusCode.UNIMPLEMENTED
        on = launcher.start_service(
            "reward",
            name="reward-reflection",
            overrides=[*common, "rlmesh.security.grpc_reflection=true"],
            env=env,
        )
        assert "rlmesh.v1.Reward" in asyncio.run(services_listed(on.grpc_address))
