"""Optional TLS on gRPC (rlmesh.security.tls), with a CA the test makes: a caller that trusts the CA
gets through, plain text and a caller trusting another CA do not; with verify_clients a caller
without a certificate is refused; a real service process serves TLS from its config."""

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.runtime.auth import client_auth_interceptors
from rlmesh.runtime.health import grpc_health
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.server import GrpcService
from rlmesh.runtime.tls import TlsFiles, aio_channel, export_tls
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.support.tls import make_tls_files

TOKEN = "tls-token"


class Reward(reward_pb2_grpc.RewardServicer):
    async def Score(self, request, context):
        return reward_pb2.ScoreResponse(results=[reward_pb2.RewardResult(uid=s.uid) for s in request.samples])


def tls_files(directory, name: str = "test", verify_clients: bool = False) -> TlsFiles:
    made = make_tls_files(directory, name=name)
    return TlsFiles(str(made.cert_file), str(made.key_file), str(made.ca_file), verify_clients)


async def start(tls: TlsFiles) -> GrpcService:
    service = GrpcService("reward", port=0, metrics_port=None, auth_token=TOKEN, shutdown_grace_s=5, tls=tls)
    service.add_servicer(reward_pb2_grpc.add_RewardServicer_to_server, Reward(), "rlmesh.v1.Reward")
    await service.start()
    return service


async def score(channel: grpc.aio.Channel) -> int:
    request = reward_pb2.ScoreRequest(samples=[reward_pb2.RewardSample(uid="u")])
    return len((await reward_pb2_grpc.RewardStub(channel).Score(request, timeout=10)).results)


async def refused(channel: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return e.value.code()


async def test_grpc_serves_only_tls_to_callers_that_trust_its_ca(tmp_path):
    tls = tls_files(tmp_path / "ca")
    service = await start(tls)
    address = f"127.0.0.1:{service.port}"
    try:
        async with aio_channel(address, interceptors=client_auth_interceptors(TOKEN), tls=tls) as channel:
            assert await score(channel) == 1
        async with grpc.aio.insecure_channel(address) as plain:
            assert await refused(plain) == grpc.StatusCode.UNAVAILABLE
        stranger = tls_files(tmp_path / "other", name="other")
        async with aio_channel(address, tls=stranger) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
    finally:
        await service.stop()


async def test_verify_clients_refuses_a_caller_without_a_certificate(tmp_path):
    tls = tls_files(tmp_path / "ca", verify_clients=True)
    service = await start(tls)
    address = f"127.0.0.1:{service.port}"
    try:
        ca_only = grpc.ssl_channel_credentials(root_certificates=Path(tls.ca_file).read_bytes())
        async with grpc.aio.secure_channel(address, ca_only) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
        async with aio_channel(address, interceptors=client_auth_interceptors(TOKEN), tls=tls) as channel:
            assert await score(channel) == 1
    finally:
        await service.stop()


def test_a_service_process_serves_tls_from_its_config(tmp_path, monkeypatch):
    tls = tls_files(tmp_path / "ca")
    overrides = [
        "rlmesh.run_id=tls",
        "rlmesh.reward.port=0",
        "rlmesh.reward.metrics_port=0",
        f"rlmesh.security.tls.cert_file={tls.cert_file}",
        f"rlmesh.security.tls.key_file={tls.key_file}",
        f"rlmesh.security.tls.ca_file={tls.ca_file}",
    ]
    env: dict[str, str] = {}
    export_tls(tls, env)
    for name, value in env.items():  # as `rlmesh train` does for itself: its probes speak TLS
        monkeypatch.setenv(name, value)
    with ProcessLauncher(tmp_path / "run", stop_grace_s=10) as launcher:
        reward = launcher.start_service("reward", overrides=overrides)
        assert grpc_health(reward.grpc_address) == "SERVING"
        with grpc.insecure_channel(reward.grpc_address) as plain:
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
