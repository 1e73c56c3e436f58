"""Redis with a password (requirepass), ACL users and TLS, against real redis-servers: a client
without or with wrong credentials is refused at once with an error that says what to fix and never
shows the password; with the right ones the queues work (a task put, claimed and acked)."""

import logging
import stat
import uuid
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError

from rlmesh.queue import RedisAccessError, RunKeys, connect, prompt_queue, retry_redis_with_deadline
from rlmesh.runtime.launcher import RedisTLS
from rlmesh.v1 import trajectory_pb2
from tests.support.tls import make_tls_files

PASSWORD = 'pw: with spaces "quotes" and @/?'  # every character a URL or redis.conf must escape
ALICE_PASSWORD = "alice-pw-91c"


def url_with(base: str, userinfo: str) -> str:
    scheme, rest = base.split("://", 1)
    host = rest.split("@", 1)[-1]  # the instance's own credentials, if any, replaced
    return f"{scheme}://{userinfo}@{host}" if userinfo else f"{scheme}://{host}"


async def round_trip(url: str) -> None:
    """A task through the prompt queue, the way a learner and a replica pass it."""
    client = connect(url)
    try:
        keys = RunKeys(f"auth-{uuid.uuid4().hex[:8]}")
        learner, replica = prompt_queue(client, keys, "learner"), prompt_queue(client, keys, "replica-a")
        await retry_redis_with_deadline(replica.ensure_group, "create prompt group")
        await learner.put([trajectory_pb2.PromptTask(uid="t0", group_uid="g0", n=1, prompt_ids=[1, 2])])
        [delivery] = await replica.claim(4)
        assert delivery.message.uid == "t0"
        await replica.ack([delivery.entry_id])
        assert await replica.pending() == 0
    finally:
        await client.aclose()


async def refusal(url: str) -> str:
    """The error the project's retry loop raises for ``url``; it must not be retried for minutes."""
    client = connect(url)
    try:
        with pytest.raises(RedisAccessError) as e:
            await retry_redis_with_deadline(client.ping, "ping", deadline_s=60)
    finally:
        await client.aclose()
    message = str(e.value)
    for secret in (PASSWORD, ALICE_PASSWORD, "wrong-pw"):
        assert secret not in message
    return message


async def test_requirepass(launcher, caplog):
    caplog.set_level(logging.INFO, logger="rlmesh.launcher")
    server = launcher.start_redis(name="redis-requirepass", password=PASSWORD)
    assert await refusal(url_with(server.url, "")) == (
        "ping: Redis needs a password and rlmesh.redis_url gives none (redis://:PASSWORD@host:port/db, "
        "or redis://USER:PASSWORD@… for an ACL user)"
    )
    assert await refusal(url_with(server.url, ":wrong-pw")) == (
        "ping: Redis refused rlmesh.redis_url's user and password: "
        "invalid username-password pair or user is disabled."
    )
    await round_trip(server.url)  # ":<password, percent-encoded>@"
    # The password is in a file only its owner reads, not on redis-server's command line or in logs.
    assert PASSWORD.encode() not in Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    secrets = server.data_dir / "secrets.conf"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    assert PASSWORD not in caplog.text and "started redis-requirepass" in caplog.text


async def test_acl_user(launcher):
    server = launcher.start_redis(
        name="redis-acl", acl_users=["default off", f"alice on >{ALICE_PASSWORD} ~* +@all"]
    )
    assert "needs a password" in await refusal(url_with(server.url, ""))
    assert "refused rlmesh.redis_url's user and password" in await refusal(
        url_with(server.url, f"alice:{ALICE_PASSWORD}x")
    )
    assert "refused" in await refusal(url_with(server.url, f"bob:{ALICE_PASSWORD}"))
    await round_trip(url_with(server.url, f"alice:{ALICE_PASSWORD}"))


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


async def test_tls(launcher, tls_files, tmp_path):
    # Debian's redis-server is built with TLS; one without fails to start here, loudly.
    tls = RedisTLS(tls_files.cert_file, tls_files.key_file, tls_files.ca_file)
    server = launcher.start_redis(name="redis-tls", password=PASSWORD, tls=tls)
    assert server.url.startswith("rediss://") and "ssl_ca_certs=" in server.url
    host = f"127.0.0.1:{server.port}"
    # The server's certificate is not checked against the system's CAs, nor another CA.
    assert "CERTIFICATE_VERIFY_FAILED" in await refusal(f"rediss://:x@{host}/0")
    other_ca = make_tls_files(tmp_path, name="other").ca_file
    message = await refusal(f"rediss://:x@{host}/0?ssl_ca_certs={other_ca}")
    assert message.startswith("ping: TLS with Redis failed") and "ssl_ca_certs=CA file" in message
    # Plain text to the TLS port: the server drops the connection (a transient error to redis-py).
    plain = connect(url_with(server.url.replace("rediss://", "redis://").split("?")[0], ":x"), retries=0)
    with pytest.raises(ConnectionError):
        await plain.ping()
    await plain.aclose()
    assert "refused rlmesh.redis_url's user and password" in await refusal(url_with(server.url, ":wrong-pw"))
    await round_trip(server.url)


async def test_tls_with_client_certificates(launcher, tls_files):
    tls = RedisTLS(tls_files.cert_file, tls_files.key_file, tls_files.ca_file, verify_clients=True)
    server = launcher.start_redis(name="redis-mtls", tls=tls)
    assert "ssl_certfile=" in server.url and "ssl_keyfile=" in server.url
    without_certificate = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={tls_files.ca_file}"
    client = connect(without_certificate, retries=0)
    with pytest.raises(ConnectionError):
        await client.ping()
    await client.aclose()
    await round_trip(server.url)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:6379", "expected redis://[[user]:password@]host:port/db, rediss://"),
        (
            "redis://:secret-1@127.0.0.1/0?ssl_ca_certs=/ca.crt",
            "ssl_ca_certs configure TLS, which needs rediss://",
        ),
        (
            "rediss://:secret-1@127.0.0.1/0?ssl_ca_certs=/no/ca.crt",
            "ssl_ca_certs='/no/ca.crt' is not a file here",
        ),
        ("rediss://:secret-1@127.0.0.1/0?ssl_cert_reqs=maybe", "ssl_cert_reqs='maybe', expected one of none"),
        ("redis://:secret-1/x@127.0.0.1:6379/0", "'redis://…' (shown no further"),
        ("redis://u:secret-1@127.0.0.1:port/0", "no host:port found; characters such as @ / ? # :"),
    ],
)
def test_a_url_that_cannot_work_is_refused_before_connecting(url, message):
    with pytest.raises(ValueError, match=r"^rlmesh\.redis_url=") as e:
        connect(url)
    assert message in str(e.value) and "secret-1" not in str(e.value)
