"""What each sample of a prompt task has generated so far, kept in Redis beside the task: a replica
that takes the task over (the first one died, or its generation was aborted) goes on from there.
docs/reliability.md#partial-rollouts"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError

from rlmesh.queue.keys import RunKeys
from rlmesh.queue.signing import INVALID, UNDECODABLE, UNTRUSTED, unwrap, wrap
from rlmesh.v1 import trajectory_pb2

PartialSample = trajectory_pb2.PartialSample
WHAT = "partial_sample"
# Left over only by a task nobody finished (its run ended or was abandoned): gone after a day.
PARTIAL_TTL_S = 24 * 3600
FINISHED = ("stop", "length")


def partial_problem(sample: PartialSample, max_new_tokens: int) -> str | None:
    """Why ``sample`` cannot be resumed from, or None: one log-prob and version per token, log-probs
    finite and at most 0, versions not negative, no more tokens than the task allows."""
    n = len(sample.output_ids)
    if len(sample.log_probs) != n or len(sample.token_policy_versions) != n:
        return (
            f"{n} output ids, {len(sample.log_probs)} log-probs and "
            f"{len(sample.token_policy_versions)} versions: must be as many"
        )
    if n > max_new_tokens:
        return f"{n} output ids, more than max_new_tokens={max_new_tokens}"
    if n == max_new_tokens and not sample.finish_reason:
        return f"{n} output ids, max_new_tokens={max_new_tokens}, and no finish reason"
    if any(not math.isfinite(lp) or lp > 1e-4 for lp in sample.log_probs):
        return "a log-prob is not finite or above 0"
    if any(v < 0 for v in sample.token_policy_versions) or any(t < 0 for t in sample.output_ids):
        return "a negative token id or version"
    if sample.finish_reason not in ("", *FINISHED):
        return f"finish_reason {sample.finish_reason!r}: must be empty or one of {FINISHED}"
    if not 0 <= sample.resumed_tokens <= n:
        return f"resumed_tokens={sample.resumed_tokens} outside 0..{n}"
    return None


class PartialStore:
    """One Redis hash per prompt task (``<run>:partial:<task uid>``), a field per sample index; each
    value signed with the run's key over the key and the field, so a value moved to another task or
    sample reads as untrusted. A value the signer does not vouch for, that does not decode, or that
    ``partial_problem`` refuses is left out (counted in ``rlmesh_redis_untrusted_total``): that
    sample is generated from the start."""

    def __init__(self, redis: aioredis.Redis, keys: RunKeys, ttl_s: int = PARTIAL_TTL_S) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s

    def key(self, task_uid: str) -> str:
        return self.keys.scoped(f"partial:{task_uid}")

    async def save(self, task_uid: str, samples: Mapping[int, PartialSample]) -> None:
        """Replaces the saved samples ``samples`` names (index -> what it has so far)."""
        if not samples:
            return
        key = self.key(task_uid)
        fields = {
            str(i): wrap(self.keys.signer, f"{key}/{i}", s.SerializeToString()) for i, s in samples.items()
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def load(self, task_uid: str, max_new_tokens: int) -> dict[int, PartialSample]:
        """The samples saved for ``task_uid`` that can be trusted and resumed from."""
        key = self.key(task_uid)
        out: dict[int, PartialSample] = {}
        for field, value in (await self.redis.hgetall(key)).items():
            where = f"{key}/{field.decode(errors='replace')}"
            payload = unwrap(self.keys.signer, where, value, WHAT)
            if payload is None:
                continue
            try:
                index = int(field)
                sample = PartialSample.FromString(payload)
            except (ValueError, DecodeError) as e:
                UNTRUSTED.count(WHAT, UNDECODABLE, f"{where}: {e}")
                continue
            problem = partial_problem(sample, max_new_tokens)
            if index < 0 or problem is not None:
                UNTRUSTED.count(WHAT, INVALID, f"{where}: {problem or 'negative sample index'}")
                continue
            out[index] = sample
        return out

    async def drop(self, task_uids: Sequence[str]) -> None:
        if task_uids:
            await self.redis.delete(*(self.key(uid) for uid in task_uids))
