"""The run's current policy in Redis: the version the learner last confirmed, and where a disk
snapshot of it lives, so a replica joining mid-run loads it before taking work. With the run's
signer the record carries a tag over both; one it does not vouch for reads as no record at all."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from rlmesh.queue.keys import RunKeys
from rlmesh.queue.signing import INVALID, UNDECODABLE, UNTRUSTED

WHAT = "policy"
VERSION, DISK_PATH, TAG = b"version", b"disk_path", b"s"


@dataclass
class PolicyState:
    version: int
    disk_path: str | None


def _signed_bytes(version: bytes, disk_path: bytes) -> bytes:
    # The version is digits: the first newline ends it, whatever the path holds.
    return version + b"\n" + disk_path


async def read_policy(redis: aioredis.Redis, keys: RunKeys) -> PolicyState:
    """The record, or version 0 and no path when there is none or it is not to be trusted
    (unsigned or signed with another key under a signer, or not a record: counted in UNTRUSTED)."""
    key = keys.scoped("policy")
    raw = await redis.hgetall(key)
    if not raw:
        return PolicyState(version=0, disk_path=None)
    version, path = raw.get(VERSION, b"0"), raw.get(DISK_PATH, b"")
    if keys.signer is not None:
        cause = keys.signer.check(key, _signed_bytes(version, path), raw.get(TAG))
        if cause is not None:
            UNTRUSTED.count(WHAT, cause, f"{key} holds a record this run's key did not sign")
            return PolicyState(version=0, disk_path=None)
    try:
        state = PolicyState(version=int(version), disk_path=path.decode() or None)
    except (ValueError, UnicodeDecodeError) as e:
        UNTRUSTED.count(WHAT, UNDECODABLE, f"{key}: {e}")
        return PolicyState(version=0, disk_path=None)
    if state.version < 0:
        UNTRUSTED.count(WHAT, INVALID, f"{key}: version {state.version}")
        return PolicyState(version=0, disk_path=None)
    return state


async def publish_policy(
    redis: aioredis.Redis, keys: RunKeys, version: int, disk_path: str | None = None
) -> None:
    """Replaces the record (a path of an earlier version never stays beside a newer version)."""
    key = keys.scoped("policy")
    raw_version, raw_path = str(int(version)).encode(), (disk_path or "").encode()
    mapping: dict[bytes, bytes] = {VERSION: raw_version}
    if disk_path:
        mapping[DISK_PATH] = raw_path
    if keys.signer is not None:
        mapping[TAG] = keys.signer.tag(key, _signed_bytes(raw_version, raw_path))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        pipe.hset(key, mapping=mapping)
        await pipe.execute()


def inside_roots(path: str, roots: Sequence[str]) -> bool:
    """Whether ``path`` lies inside one of ``roots`` (both from this process's working directory,
    ``..`` and symbolic links resolved): a record cannot point a replica at any other file."""
    target = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(root)
        if target != base and os.path.commonpath([target, base]) == base:
            return True
    return False
