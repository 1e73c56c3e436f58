"""Secrets in overrides: which they are, how they are redacted, and how a child gets them."""

import json

import pytest

from rlmesh.config import ConfigError, load_config
from rlmesh.config.secrets import (
    SECRET_OVERRIDES_ENV,
    redact_argv,
    redact_url,
    secret_env,
    split_secret_overrides,
)


def test_secret_overrides_are_split_from_the_rest():
    public, secret = split_secret_overrides(
        [
            "python",
            "--ready-file=/tmp/x",
            "rlmesh.auth_token=abc",
            "rlmesh.redis_url=redis://app:pw@10.0.0.5:6379/0",
            "rlmesh.redis_url=redis://10.0.0.5:6379/0",
            "trainer.logger=[console]",
            "+rlmesh.reward.api_key=k",
        ]
    )
    assert public == [
        "python",
        "--ready-file=/tmp/x",
        "rlmesh.redis_url=redis://10.0.0.5:6379/0",
        "trainer.logger=[console]",
    ]
    assert secret == [
        "rlmesh.auth_token=abc",
        "rlmesh.redis_url=redis://app:pw@10.0.0.5:6379/0",
        "+rlmesh.reward.api_key=k",
    ]


def test_redaction_keeps_what_helps_and_drops_the_secret():
    assert (
        redact_url("rediss://app:p%40ss@h:6380/1 and http://u:v@x")
        == "rediss://app:***@h:6380/1 and http://u:***@x"
    )
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_argv(["rlmesh.auth_token=abc", "rlmesh.redis_url=redis://:pw@h/0", "a=b"]) == [
        "rlmesh.auth_token=***",
        "rlmesh.redis_url=redis://:***@h/0",
        "a=b",
    ]


def test_a_child_reads_its_secrets_from_the_environment(monkeypatch):
    monkeypatch.setenv(SECRET_OVERRIDES_ENV, json.dumps(["rlmesh.auth_token=from-env"]))
    assert load_config(None, ["rlmesh.run_id=r1"]).rlmesh.token() == "from-env"
    assert secret_env([]) == {}
    assert json.loads(secret_env(["rlmesh.auth_token=x"])[SECRET_OVERRIDES_ENV]) == ["rlmesh.auth_token=x"]


def test_a_malformed_secret_env_is_a_config_error(monkeypatch):
    monkeypatch.setenv(SECRET_OVERRIDES_ENV, json.dumps({"rlmesh.auth_token": "x"}))
    with pytest.raises(ConfigError, match=SECRET_OVERRIDES_ENV):
        load_config(None, [])


def test_an_error_about_a_secret_override_does_not_quote_it():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rlmesh.redis_url=[redis://u:hunter2@h"])
    assert "hunter2" not in str(err.value) and "rlmesh.redis_url" in str(err.value)
