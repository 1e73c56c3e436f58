"""Proof that an entry read from Redis was written by a holder of the run's token: an HMAC tag under
a key derived from the token and the run id, over the entry's bytes and its key; ``UNTRUSTED``
counts what readers skip. docs/security.md#redis-entries"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import logging
from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

log = logging.getLogger("rlmesh.queue")

TAG_VERSION = b"v1:"
# A tag is "v1:" and 64 hex digits: readable in redis-cli, and a new scheme gets a new prefix.
TAG_LENGTH = len(TAG_VERSION) + 64
# A value signed in place (a Redis string) starts with this, then the tag, then the payload. No
# protobuf starts with a zero byte (there is no field 0), and no JSON does: bare values stay readable.
SIGNED_PREFIX = b"\x00rlmesh-signed\x00"
_LABEL = b"rlmesh redis entries v1\x00"
# A tag in Redis lets whoever can read Redis test guesses of the token offline; deriving the key
# this slowly makes each guess cost as much (about 50 ms), once per process for the real key.
_KDF_ITERATIONS = 100_000

# Why a reader did not trust an entry: the label of its count.
UNSIGNED = "unsigned"
BAD_SIGNATURE = "bad_signature"
UNDECODABLE = "undecodable"
INVALID = "invalid"


class Signer:
    """Tags and checks entries with one run's key; its repr never shows the key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("a signing key needs at least 32 bytes")
        self._key = key

    def tag(self, context: str, payload: bytes) -> bytes:
        """The tag of ``payload`` stored at ``context`` (a Redis key or stream name)."""
        mac = hmac.new(self._key, context.encode() + b"\x00" + payload, hashlib.sha256)
        return TAG_VERSION + mac.hexdigest().encode()

    def check(self, context: str, payload: bytes, tag: bytes | None) -> str | None:
        """None when ``tag`` is ``payload``'s at ``context``; else why not (UNSIGNED, BAD_SIGNATURE)."""
        if not tag:
            return UNSIGNED
        return None if hmac.compare_digest(self.tag(context, payload), tag) else BAD_SIGNATURE

    def __repr__(self) -> str:
        return "Signer(<key hidden>)"


@functools.lru_cache(maxsize=8)
def _derive(token: str, run_id: str) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", token.encode(), _LABEL + run_id.encode(), _KDF_ITERATIONS)


def signer_for(token: str | None, run_id: str) -> Signer | None:
    """The run's signer: a key derived from ``token`` and ``run_id``; None without a token."""
    return Signer(_derive(token, run_id)) if token else None


def wrap(signer: Signer | None, context: str, payload: bytes) -> bytes:
    """``payload`` as stored at Redis key ``context``: signed in place, or bare without a signer."""
    if signer is None:
        return payload
    return SIGNED_PREFIX + signer.tag(context, payload) + payload


def unwrap(signer: Signer | None, context: str, value: bytes, what: str) -> bytes | None:
    """The payload of a value read from ``context``, or None (counted in ``UNTRUSTED`` as ``what``)
    when ``signer`` does not vouch for it. Without a signer a signed value is taken as it is: there is
    no key to check it with, and nothing a key would protect."""
    tag: bytes | None = None
    if value.startswith(SIGNED_PREFIX):
        start = len(SIGNED_PREFIX)
        tag, value = value[start : start + TAG_LENGTH], value[start + TAG_LENGTH :]
    if signer is None:
        return value
    cause = signer.check(context, value, tag)
    if cause is not None:
        UNTRUSTED.count(what, cause, f"{context} holds a value this run's key did not sign")
        return None
    return value


class Untrusted:
    """Entries readers skipped, by what they were and why; each cause is logged the first time, then
    at the 10th, 100th, ... time, so a flood of forgeries cannot flood the log. A Prometheus
    collector: ``expose_untrusted`` adds it to a registry."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def count(self, what: str, cause: str, detail: str) -> None:
        key = (what, cause)
        self.counts[key] += 1
        n = self.counts[key]
        if _power_of_ten(n):
            log.warning(
                "skipped an untrusted %s entry from Redis (%s, %d so far): %s", what, cause, n, detail
            )

    def total(self, what: str | None = None, cause: str | None = None) -> int:
        return sum(
            n
            for (w, c), n in self.counts.items()
            if (what is None or w == what) and (cause is None or c == cause)
        )

    def describe(self) -> Iterator[CounterMetricFamily]:
        # Its name, so a registry refuses a second registration instead of exporting it twice.
        yield _family()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = _family()
        for (what, cause), n in sorted(self.counts.items()):
            family.add_metric([what, cause], n)
        yield family


def _family() -> CounterMetricFamily:
    return CounterMetricFamily(
        "rlmesh_redis_untrusted",
        "entries read from Redis and skipped: unsigned, signed with another key, undecodable or invalid",
        labels=["what", "cause"],
    )


def _power_of_ten(n: int) -> bool:
    """1, 10, 100, ..."""
    while n % 10 == 0:
        n //= 10
    return n == 1


# One per process: every reader counts into it, whichever service it serves.
UNTRUSTED = Untrusted()


def expose_untrusted(registry: CollectorRegistry) -> None:
    """Adds ``rlmesh_redis_untrusted_total{what,cause}`` to ``registry`` (a second call is a no-op)."""
    with contextlib.suppress(ValueError):  # already there
        registry.register(UNTRUSTED)
