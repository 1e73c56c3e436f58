"""Which address a service advertises: config, then env RLMESH_ADVERTISE_HOST, then its bound host,
then (bound to a wildcard) a routable one; and the weight-sync rendezvous host that follows from it."""

import logging

import pytest

from rlmesh.config import ConfigError, load_config
from rlmesh.learner.weight_sync.push import weight_master_address
from rlmesh.runtime.launcher import dial_address
from rlmesh.runtime.net import (
    ENV_ADVERTISE_HOST,
    OpenBindError,
    advertised_address,
    advertised_host,
    check_open_bind,
    is_loopback,
    routable_host,
)

REDIS = "redis://127.0.0.1:6379/0"


def advertise(bind: str, port: int = 50053, config: str | None = None, env: str | None = None) -> str:
    environ = {ENV_ADVERTISE_HOST: env} if env is not None else {}
    return advertised_address(
        bind, port, advertise=config, key="rlmesh.rollout.advertise_address", redis_url=REDIS, environ=environ
    )


def test_the_config_key_wins_over_the_environment_and_the_bound_host():
    assert advertise("10.1.0.5", config="203.0.113.7:6000", env="10.9.9.9") == "203.0.113.7:6000"


def test_a_config_host_without_a_port_keeps_the_bound_port():
    assert (
        advertise("0.0.0.0", 50061, config="replica-3.internal", env="10.9.9.9") == "replica-3.internal:50061"
    )


def test_the_environment_wins_over_the_bound_host():
    assert advertise("10.1.0.5", 50061, env="10.9.9.9") == "10.9.9.9:50061"
    assert advertise("0.0.0.0", 50061, env="[fd00::9]") == "[fd00::9]:50061"


def test_without_either_a_specific_bound_host_is_advertised_as_bound():
    assert advertise("10.1.0.5", 50061) == "10.1.0.5:50061"
    assert advertise("127.0.0.1", 50061, env="") == "127.0.0.1:50061"
    assert advertise("fd00::5", 50061) == "[fd00::5]:50061"


def test_a_wildcard_is_never_advertised():
    for wildcard in ("0.0.0.0", "::"):
        host = advertised_host(wildcard, advertise=None, key="k", redis_url=REDIS, environ={})
        assert host not in ("0.0.0.0", "::", "")
        assert host == routable_host(REDIS)


def test_with_redis_on_loopback_the_routable_host_is_the_hostnames_address_or_loopback(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "localhost")
    assert routable_host(REDIS) == "127.0.0.1"


@pytest.mark.parametrize(
    ("env", "problem"),
    [("10.0.0.1:5000", "a host only"), ("0.0.0.0", "wildcard"), ("no spaces", "expected host")],
)
def test_a_bad_environment_value_is_refused_naming_the_variable(env, problem):
    with pytest.raises(ValueError, match=ENV_ADVERTISE_HOST) as e:
        advertise("10.1.0.5", env=env)
    assert problem in str(e.value)


@pytest.mark.parametrize("value", ["0.0.0.0:50051", "host:99999", "fd00::1", "a b"])
def test_a_bad_advertise_address_in_the_config_names_the_key(value):
    with pytest.raises(ConfigError, match=r"rlmesh\.reward\.advertise_address"):
        load_config(None, [f"rlmesh.reward.advertise_address={value}"])


def test_every_service_has_the_key_and_the_rollouts_host_port_form_still_works():
    cfg = load_config(None, ["rlmesh.rollout.advertise_address=10.2.0.8:7000"])
    assert cfg.rlmesh.rollout.advertise_address == "10.2.0.8:7000"
    assert all(s.advertise_address is None for n, s in cfg.rlmesh.services().items() if n != "rollout")
    # Clients keep dialing what addresses/host say: advertising is for what a service publishes.
    assert cfg.rlmesh.rollout.client_addresses() == ["127.0.0.1:50053"]


def test_the_rendezvous_host_is_the_learners_advertised_host_unless_set(monkeypatch):
    monkeypatch.delenv(ENV_ADVERTISE_HOST, raising=False)
    assert weight_master_address(load_config(None, [])) == "127.0.0.1"
    assert weight_master_address(load_config(None, ["rlmesh.learner.host=10.3.0.1"])) == "10.3.0.1"
    cfg = load_config(None, ["rlmesh.learner.host=0.0.0.0", "rlmesh.learner.advertise_address=learner-0"])
    assert weight_master_address(cfg) == "learner-0"
    monkeypatch.setenv(ENV_ADVERTISE_HOST, "10.4.0.1")
    assert weight_master_address(load_config(None, ["rlmesh.learner.host=10.3.0.1"])) == "10.4.0.1"
    explicit = ["rlmesh.learner.host=10.3.0.1", "rlmesh.weight_sync.master_address=10.5.0.1"]
    assert weight_master_address(load_config(None, explicit)) == "10.5.0.1"


def test_a_launcher_dials_what_a_wildcard_bound_service_advertises():
    assert dial_address({"grpc_address": "0.0.0.0:5", "advertise_address": "10.6.0.2:5"}) == "10.6.0.2:5"
    assert (
        dial_address({"grpc_address": "127.0.0.1:5", "advertise_address": "203.0.113.1:5"}) == "127.0.0.1:5"
    )


def test_binding_beyond_loopback_without_a_token_is_refused_unless_allowed(caplog):
    with pytest.raises(OpenBindError, match=r"the reward service binds 0\.0\.0\.0.*allow_open_bind=true"):
        check_open_bind("0.0.0.0", "the reward service", None)
    with pytest.raises(OpenBindError, match=r"binds 10\.0\.0\.7"):
        check_open_bind("10.0.0.7", "the reward service", "")
    assert not check_open_bind("0.0.0.0", "the reward service", "s3cret")
    assert not check_open_bind("127.0.0.1", "the reward service", None)
    assert not check_open_bind("::1", "the reward service", None)
    with caplog.at_level(logging.WARNING, logger="rlmesh.runtime"):
        assert check_open_bind("0.0.0.0", "the reward service", None, allow_open=True)
    assert [r.getMessage() for r in caplog.records if "without rlmesh.auth_token" in r.getMessage()] == [
        "the reward service binds 0.0.0.0 without rlmesh.auth_token (rlmesh.security.allow_open_bind=true): "
        "anyone who can reach it can call it"
    ]
    assert is_loopback("localhost") and not is_loopback("0.0.0.0")
