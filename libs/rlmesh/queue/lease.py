"""One learner per run id: a Redis key held under a lease that its holder keeps renewing.

docs/reliability.md#guards-that-keep-a-long-run-bounded"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from rlmesh.queue.connection import TRANSIENT_ERRORS

log = logging.getLogger("rlmesh.queue")

STANDBY_POLL_S = 0.2  # how often a standby (an unbounded wait) looks at the lease

# Renew or release only while the key still holds our token: a lease that ran out may be another's.
# A key that expired while Redis was away (an outage longer than the lease) is taken again.
_RENEW = (
    "local v = redis.call('GET', KEYS[1]) "
    "if v == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end "
    "if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end "
    "return 0"
)
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# Take the key over from ARGV[1], a holder known dead, unless it changed hands meanwhile.
_TAKE_OVER = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end return false"
)


def dead_here(holder: bytes | None) -> bool:
    """Whether ``holder`` (a lease's value) names a process of this host that no longer exists:
    its lease can be taken at once instead of waited out. A process of another host (or container:
    another hostname), or a value that is not a holder's, never counts as dead."""
    try:
        who = json.loads(holder or b"")
        host, pid = who["host"], int(who["pid"])
    except (ValueError, TypeError, KeyError):
        return False
    if host != socket.gethostname() or pid == os.getpid() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class LeaseHeldError(RuntimeError):
    """Another live process holds the lease."""


class RunLease:
    def __init__(self, redis: aioredis.Redis, key: str, lease_s: float, what: str = "learner") -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.redis = redis
        self.key = key
        self.lease_ms = int(lease_s * 1000)
        self.what = what
        self.token = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": int(time.time())})
        self.lost = False  # set when a renewal found the key gone or someone else's

    async def acquire(self, wait_s: float | None = None, stopped: Callable[[], bool] | None = None) -> bool:
        """Takes the lease, waiting up to ``wait_s`` (default 1.5 leases: a dead holder's runs out;
        ``math.inf``: a standby's wait); at once from a holder of this host whose process is gone
        (``dead_here``). Returns False when ``stopped()`` turned true first."""
        wait_s = 1.5 * self.lease_ms / 1000 if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        announced = False
        # A standby polls often: its takeover time is the point of it, and a GET is cheap.
        poll_s = STANDBY_POLL_S if math.isinf(wait_s) else min(1.0, self.lease_ms / 3000)
        while not await self.redis.set(self.key, self.token, nx=True, px=self.lease_ms):
            holder = await self.redis.get(self.key)
            if dead_here(holder) and await self.redis.eval(
                _TAKE_OVER, 1, self.key, holder, self.token, self.lease_ms
            ):
                log.warning("%s was held by %s, which is dead: took it over", self.key, holder)
                return True
            if time.monotonic() > deadline:
                raise LeaseHeldError(
                    f"{self.key} is held by another {self.what} ({(holder or b'?').decode(errors='replace')}), which keeps "
                    f"renewing it: one {self.what} per run id; stop that one or use another rlmesh.run_id"
                )
            if stopped is not None and stopped():
                return False
            if not announced:
                how_long = "as long as it is held" if math.isinf(wait_s) else f"up to {wait_s:.0f} s"
                log.warning(
                    "%s is held (%s); waiting %s for its lease to run out", self.key, holder, how_long
                )
                announced = True
            await asyncio.sleep(poll_s)
        return True

    async def keep(self) -> None:
        """Renews every third of the lease until cancelled; sets ``lost`` once another holds the key.
        Redis being away is not a loss: the first renewal after it decides (and takes the key back
        if it expired meanwhile)."""
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                renewed = await self.redis.eval(_RENEW, 1, self.key, self.token, self.lease_ms)
            except TRANSIENT_ERRORS as e:
                log.warning("could not renew %s: %s", self.key, e)
                continue
            if not renewed:
                self.lost = True
                log.error("lost %s: another %s holds it now", self.key, self.what)
                return

    async def release(self) -> None:
        await self.redis.eval(_RELEASE, 1, self.key, self.token)
