"""The autoscaler's word to the actuators: the desired replica count, the replicas it counted live
and why, one JSON value signed with the run's keys (``<run>:fleet_target``). An actuator acts on a
target the signer vouches for and only on that. docs/control.md#autoscaling"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rlmesh.queue.keys import RunKeys
from rlmesh.queue.signing import INVALID, UNDECODABLE, UNTRUSTED, unwrap, wrap

FLEET_TARGET = "fleet_target"
WHAT = "fleet_target"
MAX_REPLICAS = 100_000  # a bound no real fleet reaches: a larger count is not a target but garbage


@dataclass(frozen=True)
class FleetTarget:
    desired: int
    live: list[str] = field(default_factory=list)  # replica ids the autoscaler counted
    reason: str = ""
    unix_ms: int = 0


def fleet_target_key(keys: RunKeys) -> str:
    return keys.scoped(FLEET_TARGET)


def encode_fleet_target(keys: RunKeys, target: FleetTarget) -> bytes:
    key = fleet_target_key(keys)
    return wrap(keys.signer, key, json.dumps(asdict(target)).encode())


def decode_fleet_target(keys: RunKeys, value: bytes | None) -> FleetTarget | None:
    """The target a value holds; None when there is none, or the run's signer does not vouch for it,
    or it is not a target (counted in ``UNTRUSTED``)."""
    if value is None:
        return None
    key = fleet_target_key(keys)
    payload = unwrap(keys.signer, key, value, WHAT)
    if payload is None:
        return None
    try:
        raw: Any = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        UNTRUSTED.count(WHAT, UNDECODABLE, f"{key} is not JSON: {e}")
        return None
    try:
        desired, live = raw["desired"], raw.get("live", [])
        if not isinstance(desired, int) or isinstance(desired, bool) or not 0 <= desired <= MAX_REPLICAS:
            raise ValueError(f"desired must be an integer in [0, {MAX_REPLICAS}], got {desired!r}")
        if not isinstance(live, list) or not all(isinstance(r, str) for r in live):
            raise ValueError("live must be a list of replica ids")
        return FleetTarget(
            desired=desired,
            live=live,
            reason=str(raw.get("reason", ""))[:500],
            unix_ms=int(raw.get("unix_ms", 0)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        UNTRUSTED.count(WHAT, INVALID, f"{key}: {e}")
        return None


async def publish_fleet_target(redis: Any, keys: RunKeys, target: FleetTarget) -> None:
    """One SET; ``unix_ms`` is stamped now when the target has none."""
    if not target.unix_ms:
        target = FleetTarget(target.desired, list(target.live), target.reason, int(time.time() * 1000))
    await redis.set(fleet_target_key(keys), encode_fleet_target(keys, target))
