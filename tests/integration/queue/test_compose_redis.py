"""The compose stack's Redis (deploy/redis-entrypoint.sh, run here on a real redis-server): it
refuses to start without a password, turns the default user off, and gives the services one ACL
user limited to rlmesh's keys, without dangerous commands, with a memory bound and noeviction."""

import os
import subprocess
from pathlib import Path

import pytest
import redis as redis_sync

from rlmesh.queue.connection import connect
from rlmesh.queue.keys import RunKeys
from rlmesh.runtime.net import free_port
from tests.support.polling import wait_until
from tests.support.repo import REPO

ENTRYPOINT = REPO / "deploy" / "redis-entrypoint.sh"
PASSWORD = "s3cret-pass_word.1"


def entrypoint(tmp_path, password: str | None, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RLMESH_REDIS_PASSWORD"}
    env |= {"TMPDIR": str(tmp_path), "RLMESH_REDIS_DIR": str(tmp_path), "RLMESH_REDIS_MAXMEMORY": "64mb"}
    if password is not None:
        env["RLMESH_REDIS_PASSWORD"] = password
    return subprocess.Popen(
        ["sh", str(ENTRYPOINT), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize(
    ("password", "why"), [(None, "set RLMESH_REDIS_PASSWORD"), ("a b@c", "only letters")]
)
def test_it_refuses_to_start_without_a_usable_password(tmp_path, password, why):
    proc = entrypoint(tmp_path, password, "--port", str(free_port()))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and why in out


@pytest.fixture
def compose_redis(tmp_path):
    port = free_port()
    proc = entrypoint(tmp_path, PASSWORD, "--port", str(port), "--save", "", "--appendonly", "no")
    user = redis_sync.Redis(port=port, username="rlmesh", password=PASSWORD, socket_timeout=5)

    def answers() -> bool:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return user.ping()
        except redis_sync.ConnectionError:
            return False

    wait_until(answers, 30, "the compose Redis to answer")
    yield port, proc
    proc.terminate()
    proc.wait(timeout=30)


async def test_the_services_user_reaches_only_rlmeshs_keys(compose_redis, tmp_path):
    port, proc = compose_redis
    anonymous = redis_sync.Redis(port=port, socket_timeout=5)
    with pytest.raises(redis_sync.AuthenticationError):
        anonymous.get("x")
    user = redis_sync.Redis(port=port, username="rlmesh", password=PASSWORD, socket_timeout=5)
    keys = RunKeys("compose")
    user.xadd(keys.prompts, {"t": b"1"})
    for denied in (lambda: user.set("other", 1), user.flushall, lambda: user.config_get("maxmemory")):
        with pytest.raises(redis_sync.exceptions.NoPermissionError):
            denied()
    # What the services do, through rlmesh's own client and a URL whose password came from the env.
    client = connect(f"redis://rlmesh:{PASSWORD}@127.0.0.1:{port}/0")
    assert await client.xlen(keys.prompts) == 1
    await client.aclose()
    # The password is in neither the server's argv nor a file others can read.
    assert PASSWORD not in Path(f"/proc/{proc.pid}/cmdline").read_text()
    conf = tmp_path / "rlmesh-redis.conf"
    assert conf.stat().st_mode & 0o077 == 0
    memory = conf.read_text()
    assert "maxmemory 64mb" in memory and "maxmemory-policy noeviction" in memory
