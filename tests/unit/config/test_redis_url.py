"""rlmesh.redis_url: the forms Redis takes (password, ACL user, TLS) load; one that cannot work is
a config error that says why and never repeats the password."""

import pytest

from rlmesh.config import ConfigError, load_config


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://:requirepass-pw@127.0.0.1:6379/0",
        "redis://alice:acl-pw@redis.internal:6380/2",
        "redis://:p%40ss%2Fw%3Ard@127.0.0.1:6379/0",  # %-encoded @ / :
        "rediss://:pw@redis.internal:6380/0?ssl_ca_certs=/etc/rlmesh/ca.crt",
        "rediss://alice:pw@redis.internal/0?ssl_ca_certs=/ca.crt&ssl_certfile=/c.pem&ssl_keyfile=/k.pem",
        "rediss://redis.internal/0?ssl_cert_reqs=none",
        "unix:///run/redis/redis.sock?db=1",
    ],
)
def test_the_forms_redis_takes_load(url):
    assert load_config(None, [f"rlmesh.redis_url={url}"]).rlmesh.redis_url == url


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://:hunter2@127.0.0.1:6379", "'http://:***@127.0.0.1:6379': expected redis://"),
        (
            "redis://:hunter2@h:6379/0?ssl_ca_certs=/ca.crt",
            "ssl_ca_certs configure TLS, which needs rediss://",
        ),
        ("rediss://:hunter2@h:6379/0?ssl_cert_reqs=sometimes", "ssl_cert_reqs='sometimes', expected one of"),
        ("redis://:hunter2/x@h:6379/0", "'redis://…' (shown no further, in case it holds a password)"),
        ("redis://:hunter2@h:63a9/0", "no host:port found"),
    ],
)
def test_a_url_that_cannot_work_is_a_config_error_without_its_password(url, problem):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"rlmesh.redis_url={url}"])
    assert str(e.value).startswith("- bad value for 'rlmesh.redis_url': ")
    assert problem in str(e.value) and "hunter2" not in str(e.value)


def test_a_token_of_the_wrong_type_is_not_repeated():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rlmesh.auth_token=[hunter2]"])
    assert "hunter2" not in str(e.value) and "expected a string" in str(e.value)
