"""The embedded engine over HTTPS (rlmesh.security.tls, exported to it in the environment as a
replica does): its URL is https://, rlmesh's engine client gets through with the run's CA, a client
that trusts another CA or speaks plain HTTP does not."""

import httpx
import pytest

from rlmesh.engine.client import EngineClient
from rlmesh.runtime.tls import TlsFiles, export_tls
from tests.support.tls import make_tls_files


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsFiles:
    made = make_tls_files(tmp_path_factory.mktemp("tls"))
    return TlsFiles(str(made.cert_file), str(made.key_file), str(made.ca_file))


@pytest.fixture(scope="module")
def tls_env(tls):
    env: dict[str, str] = {}
    export_tls(tls, env)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():  # the launcher probes and the client connect with them
            mp.setenv(name, value)
        yield env


@pytest.fixture(scope="module")
def engine(launcher, tiny_model_dir, tls_env):
    return launcher.start_engine(tiny_model_dir, name="engine-tls", env=tls_env, timeout_s=120)


async def test_the_engine_serves_https_to_clients_that_trust_the_runs_ca(engine, tls, tmp_path):
    assert engine.url.startswith("https://127.0.0.1:")
    client = EngineClient(engine.url, token="")
    try:
        info = await client.model_info()
        assert info
    finally:
        await client.aclose()
    with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP gets no answer
        httpx.get(engine.url.replace("https://", "http://") + "/health", timeout=10)
    other = make_tls_files(tmp_path, name="other")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(engine.url + "/health", verify=str(other.ca_file), timeout=10)
    assert httpx.get(engine.url + "/health", verify=tls.ca_file, timeout=10).status_code == 200
