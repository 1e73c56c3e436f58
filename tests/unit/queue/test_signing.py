"""The run's signing key, tags, signed values, the count of what readers skip, and the form checks
of the addresses read from Redis."""

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rlmesh.config.address_checks import check_engine_url, check_peer_address
from rlmesh.queue.keys import RunKeys
from rlmesh.queue.policy import inside_roots
from rlmesh.queue.signing import (
    BAD_SIGNATURE,
    SIGNED_PREFIX,
    UNSIGNED,
    UNTRUSTED,
    Untrusted,
    expose_untrusted,
    signer_for,
    unwrap,
    wrap,
)

TOKEN = "unit-token-5e1"


def test_the_key_is_derived_from_token_and_run_never_the_token():
    a = signer_for(TOKEN, "run-a")
    assert signer_for(None, "run-a") is None and signer_for("", "run-a") is None
    assert a._key != TOKEN.encode() and TOKEN not in repr(a) and len(a._key) == 32
    assert a._key == signer_for(TOKEN, "run-a")._key  # the same in every process of the run
    assert a._key != signer_for(TOKEN, "run-b")._key  # another run: another key
    assert a._key != signer_for(TOKEN + "x", "run-a")._key


def test_a_tag_vouches_for_exact_bytes_at_one_place():
    signer = signer_for(TOKEN, "run")
    tag = signer.tag("k1", b"payload")
    assert tag.startswith(b"v1:") and len(tag) == 67
    assert signer.check("k1", b"payload", tag) is None
    assert signer.check("k1", b"payload!", tag) == BAD_SIGNATURE  # other bytes
    assert signer.check("k2", b"payload", tag) == BAD_SIGNATURE  # moved to another key
    assert signer.check("k1", b"payload", None) == UNSIGNED
    other = signer_for("another-token", "run")
    assert other.check("k1", b"payload", tag) == BAD_SIGNATURE


def test_wrapped_values_are_read_back_and_forgeries_are_skipped_and_counted():
    signer = signer_for(TOKEN, "run")
    value = wrap(signer, "k", b"\x0a\x01x")
    assert value.startswith(SIGNED_PREFIX) and value.endswith(b"\x0a\x01x")
    assert unwrap(signer, "k", value, "unit") == b"\x0a\x01x"
    before = UNTRUSTED.total("unit")
    assert unwrap(signer, "k", b"\x0a\x01x", "unit") is None  # bare: unsigned
    assert unwrap(signer, "k", wrap(signer_for("evil", "run"), "k", b"x"), "unit") is None
    assert unwrap(signer, "other", value, "unit") is None
    assert UNTRUSTED.total("unit") == before + 3
    assert UNTRUSTED.total("unit", UNSIGNED) >= 1 and UNTRUSTED.total("unit", BAD_SIGNATURE) >= 2
    # Without a key nothing is checked: bare values as today, signed ones taken as they are.
    assert wrap(None, "k", b"bare") == b"bare"
    assert unwrap(None, "k", b"bare", "unit") == b"bare"
    assert unwrap(None, "k", value, "unit") == b"\x0a\x01x"


def test_skips_are_logged_once_per_cause_then_at_powers_of_ten(caplog):
    counter = Untrusted()
    with caplog.at_level(logging.WARNING, logger="rlmesh.queue"):
        for _ in range(150):
            counter.count("registry", UNSIGNED, "detail")
        counter.count("registry", BAD_SIGNATURE, "detail")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4  # unsigned: 1st, 10th, 100th; bad_signature: 1st
    assert counter.total("registry") == 151 and counter.total(cause=UNSIGNED) == 150


def test_the_count_is_a_prometheus_counter_exposed_once():
    registry = CollectorRegistry()
    expose_untrusted(registry)
    expose_untrusted(registry)  # a second caller in the same process: no error
    UNTRUSTED.count("unit-metric", UNSIGNED, "detail")
    value = registry.get_sample_value(
        "rlmesh_redis_untrusted_total", {"what": "unit-metric", "cause": UNSIGNED}
    )
    assert value == UNTRUSTED.total("unit-metric", UNSIGNED) >= 1
    assert generate_latest(registry).decode().count("# TYPE rlmesh_redis_untrusted_total counter") == 1


def test_run_keys_carry_the_signer_without_it_changing_their_identity():
    signed = RunKeys.signed("run", TOKEN)
    assert signed.signer is not None and RunKeys.signed("run", None).signer is None
    assert signed == RunKeys("run") and hash(signed) == hash(RunKeys("run"))
    assert TOKEN not in repr(signed) and "Signer" not in repr(signed)


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "reward:50051", "[::1]:9", "10.0.0.7:65535"])
def test_service_addresses_pass(address):
    assert check_peer_address(address) == address


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254:80",  # a cloud's instance metadata: credentials
        "[fe80::1]:80",
        "[::ffff:169.254.169.254]:80",
        "0.0.0.0:50051",
        "224.0.0.1:5000",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "host",
        "http://host:80",
        "a b:80",
        "",
    ],
)
def test_what_is_no_service_address_is_refused(address):
    with pytest.raises(ValueError):
        check_peer_address(address)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:30000", "https://engine.example:443/", "http://[::1]:30000", "http://e"]
)
def test_engine_urls_pass(url):
    assert check_engine_url(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "ftp://host:21",
        "file:///etc/passwd",
        "http://169.254.169.254/latest/meta-data",
        "http://user:pw@host:80",
        "http://host:0",
        "http://host:99999",
        "http://host:80/?q=1",
        "http://:80",
        "host:30000",
        "",
    ],
)
def test_what_is_no_engine_url_is_refused(url):
    with pytest.raises(ValueError):
        check_engine_url(url)


def test_weights_paths_must_lie_inside_the_runs_directories(tmp_path):
    root = tmp_path / "weights"
    (root / "v3").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    assert inside_roots(str(root / "v3"), [str(root)])
    assert inside_roots(str(root / "v9"), [str(tmp_path / "ckpt"), str(root)])  # need not exist yet
    assert not inside_roots(str(root), [str(root)])  # the directory itself is no snapshot
    assert not inside_roots(str(root / ".." / "elsewhere"), [str(root)])
    assert not inside_roots(str(root / "escape"), [str(root)])  # a link out of it
    assert not inside_roots("/etc", [str(root)])
    assert not inside_roots(str(root / "v3"), [])
