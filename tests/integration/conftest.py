"""A private redis-server for the tests of a module, a client of it, and a fresh run's keys."""

import uuid

import pytest

from rlmesh.queue import RunKeys, connect
from rlmesh.runtime.launcher import ProcessLauncher


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("redis"), stop_grace_s=10) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def redis_server(launcher):
    return launcher.start_redis()


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def keys():
    return RunKeys(f"test-{uuid.uuid4().hex[:8]}")
