"""The fleet target as stored: signed with the run's keys, read back only when they vouch for it
and it is a target."""

from __future__ import annotations

import json

import pytest

from rlmesh.queue.fleet_target import FleetTarget, decode_fleet_target, encode_fleet_target
from rlmesh.queue.keys import RunKeys
from rlmesh.queue.signing import UNTRUSTED, wrap

KEYS = RunKeys.signed("run-a", "token-a")


def test_a_target_reads_back_as_written():
    target = FleetTarget(desired=3, live=["rollout-0", "rollout-1"], reason="load", unix_ms=5)
    assert decode_fleet_target(KEYS, encode_fleet_target(KEYS, target)) == target


def test_a_target_signed_with_another_runs_keys_is_refused_and_counted():
    before = UNTRUSTED.total("fleet_target")
    other = encode_fleet_target(RunKeys.signed("run-a", "another token"), FleetTarget(desired=50))
    assert decode_fleet_target(KEYS, other) is None
    assert UNTRUSTED.total("fleet_target") == before + 1


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        json.dumps({"live": []}).encode(),
        json.dumps({"desired": -1}).encode(),
        json.dumps({"desired": 10**9}).encode(),
        json.dumps({"desired": 2.5}).encode(),
        json.dumps({"desired": True}).encode(),
        json.dumps({"desired": 2, "live": "rollout-0"}).encode(),
        json.dumps([1, 2]).encode(),
    ],
)
def test_a_signed_value_that_is_not_a_target_is_refused(payload):
    key = KEYS.scoped("fleet_target")
    assert decode_fleet_target(KEYS, wrap(KEYS.signer, key, payload)) is None


def test_no_value_is_no_target():
    assert decode_fleet_target(KEYS, None) is None
