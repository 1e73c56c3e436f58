"""The run's moving parts as the control plane sees them: replicas (registry and Rollout services),
reward services and the queues with their dead letters; what it reads from Redis is checked with
the signer of its keys (docs/security.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import ResponseError

from rlmesh.config.address_checks import check_address
from rlmesh.control.errors import ControlError, from_rpc_error
from rlmesh.queue import ReplicaRegistry, RunKeys, prompt_queue, trajectory_queue
from rlmesh.queue.streams import PAYLOAD, TAG
from rlmesh.reward.addresses import get_reward_addresses, set_reward_addresses
from rlmesh.runtime.auth import bearer_metadata
from rlmesh.v1 import common_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc

PROBE_TIMEOUT_S = 2.0


async def grpc_health(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """SERVING, NOT_SERVING, ... or ``UNREACHABLE: <code>``, without blocking the event loop."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            return f"UNREACHABLE: {e.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# ----- rollout replicas -----
async def _replica_info(address: str, token: str | None) -> rollout_pb2.RolloutInfo | str:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            return await rollout_pb2_grpc.RolloutStub(channel).GetInfo(
                common_pb2.Empty(), timeout=PROBE_TIMEOUT_S, metadata=bearer_metadata(token)
            )
        except grpc.aio.AioRpcError as e:
            return f"UNREACHABLE: {e.code().name}"


async def list_replicas(registry: ReplicaRegistry, token: str | None) -> list[dict[str, Any]]:
    """Every live registration, with what its ``Rollout.GetInfo`` says now (tokens/s, tasks in
    flight); a replica that does not answer is listed with its health as UNREACHABLE."""
    regs = await registry.live()
    infos = await asyncio.gather(*(_replica_info(r.grpc_address, token) for r in regs))
    now_ms = time.time() * 1000
    out = []
    for reg, info in zip(regs, infos, strict=True):
        row: dict[str, Any] = {
            "replica_id": reg.replica_id,
            "address": reg.grpc_address,
            "engine_url": reg.engine_url,
            "engine": reg.engine,
            "policy_version": reg.policy_version,
            "state": reg.state,
            "capacity": reg.capacity,
            "last_heartbeat_unix_ms": reg.heartbeat_unix_ms,
            "heartbeat_age_s": round(max(0.0, now_ms - reg.heartbeat_unix_ms) / 1000, 3),
        }
        if isinstance(info, str):
            row.update(health=info, tokens_per_s=None, tasks_in_flight=None, tasks_done=None)
        else:
            row.update(
                health="SERVING",
                state=info.state or reg.state,
                policy_version=info.policy_version,
                tokens_per_s=info.tokens_per_s,
                tasks_in_flight=info.running_requests,
                tasks_done=info.tasks_done,
            )
        out.append(row)
    return out


async def find_replica(registry: ReplicaRegistry, replica_id: str) -> Any:
    for reg in await registry.live():
        if reg.replica_id == replica_id:
            return reg
    raise ControlError(404, f"replica_id: no live replica {replica_id!r} in the registry")


async def drain_replica(address: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    """``Rollout.Drain``: it stops claiming, finishes its tasks within ``timeout_s`` (the rest go
    back to the queue) and leaves the registry; the process stays up, idle."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await rollout_pb2_grpc.RolloutStub(channel).Drain(
                rollout_pb2.DrainRequest(timeout_s=timeout_s),
                timeout=timeout_s + 10,
                metadata=bearer_metadata(token),
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(f"replica at {address}", e) from None
    return {"drained": reply.drained, "unfinished": reply.unfinished, "message": reply.message}


# ----- reward services -----
async def reward_addresses(
    redis: aioredis.Redis, run: str | RunKeys, configured: Sequence[str]
) -> tuple[list[str], str]:
    """The addresses replicas call now, and where they come from (redis, or config). ``run``: the
    run's keys, whose signer checks the list (a run id: no check)."""
    listed = await get_reward_addresses(redis, run)
    return (listed, "redis") if listed else (list(configured), "config")


async def _reward_info(address: str, token: str | None) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            info = await reward_pb2_grpc.RewardStub(channel).GetInfo(
                common_pb2.Empty(), timeout=PROBE_TIMEOUT_S, metadata=bearer_metadata(token)
            )
        except grpc.aio.AioRpcError as e:
            return {"health": f"UNREACHABLE: {e.code().name}", "functions": None, "max_batch_size": None}
    return {"health": "SERVING", "functions": list(info.functions), "max_batch_size": info.max_batch_size}


async def list_rewards(addresses: Sequence[str], token: str | None) -> list[dict[str, Any]]:
    infos = await asyncio.gather(*(_reward_info(a, token) for a in addresses))
    return [{"address": a, **info} for a, info in zip(addresses, infos, strict=True)]


def checked_addresses(addresses: Sequence[str], field: str) -> list[str]:
    out = []
    for i, address in enumerate(addresses):
        try:
            out.append(check_address(address))
        except ValueError as e:
            raise ControlError(422, f"{field}[{i}]: {e}") from None
    if len(set(out)) != len(out):
        raise ControlError(422, f"{field}: an address is listed twice")
    return out


async def require_serving(addresses: Sequence[str], field: str) -> None:
    """Refuses addresses whose gRPC health is not SERVING: replicas would be pointed at nothing."""
    states = await asyncio.gather(*(grpc_health(a) for a in addresses))
    bad = [f"{a} ({s})" for a, s in zip(addresses, states, strict=True) if s != "SERVING"]
    if bad:
        raise ControlError(
            409, f"{field}: not serving: {', '.join(bad)}; start the service first, or pass force=true"
        )


async def set_rewards(redis: aioredis.Redis, run: str | RunKeys, addresses: Sequence[str]) -> list[str]:
    """One atomic SET of the list (signed with the signer of ``run``'s keys): every replica's reward
    client follows within half a second; calls in flight finish where they are, and a failed one is
    retried on the new list."""
    return await set_reward_addresses(redis, run, addresses)


# ----- queues -----
def _queues(redis: aioredis.Redis, keys: RunKeys) -> dict[str, Any]:
    # Read-only views: a consumer name is needed but this one never claims.
    return {
        "prompts": prompt_queue(redis, keys, "control"),
        "trajectories": trajectory_queue(redis, keys, "control"),
    }


async def queue_depths(redis: aioredis.Redis, keys: RunKeys) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, queue in _queues(redis, keys).items():
        length = await queue.length()
        try:
            pending = await queue.pending()
        except ResponseError:  # no consumer group yet: nothing handed out
            pending = 0
        out[name] = {"stream": queue.stream, "length": length, "pending": pending, "unread": length - pending}
    out["dead_letters"] = {"stream": keys.dead_letters, "length": int(await redis.xlen(keys.dead_letters))}
    return out


def _text(fields: dict[bytes, bytes], key: bytes) -> str:
    return fields.get(key, b"").decode(errors="replace")


async def dead_letters(redis: aioredis.Redis, keys: RunKeys, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` dead letters, newest first."""
    out = []
    for entry_id, fields in await redis.xrevrange(keys.dead_letters, count=limit):
        stream = _text(fields, b"stream")
        out.append(
            {
                "id": entry_id.decode(),
                "queue": stream.rsplit(":", 1)[-1],
                "stream": stream,
                "entry_id": _text(fields, b"entry_id"),
                "reason": _text(fields, b"reason"),
                "deliveries": int(_text(fields, b"deliveries") or 0),
                "payload_bytes": len(fields.get(PAYLOAD, b"")),
            }
        )
    return out


async def replay_dead_letter(redis: aioredis.Redis, keys: RunKeys, dead_id: str) -> dict[str, Any]:
    """Puts a dead letter's message back on its own stream (as a new entry, its delivery count
    fresh) and removes it from the dead letters, in one transaction. It goes back with its own tag,
    never a new one: an entry dead-lettered as forged is refused again, not laundered."""
    try:
        found = await redis.xrange(keys.dead_letters, min=dead_id, max=dead_id)
    except ResponseError as e:  # digits past 2**64: not an id Redis takes
        raise ControlError(422, f"dead_letter_id: {dead_id!r} is not a stream entry id ({e})") from None
    if not found:
        raise ControlError(404, f"dead_letter_id: no dead letter {dead_id!r}")
    fields = found[0][1]
    stream = _text(fields, b"stream")
    if stream not in (keys.prompts, keys.trajectories):
        raise ControlError(409, f"dead_letter_id: {dead_id!r} came from {stream!r}, not a queue of this run")
    payload = fields.get(PAYLOAD, b"")
    if not payload:
        raise ControlError(409, f"dead_letter_id: {dead_id!r} has no payload to replay (it was malformed)")
    entry = {PAYLOAD: payload}
    if fields.get(TAG):
        entry[TAG] = fields[TAG]
    async with redis.pipeline(transaction=True) as pipe:
        pipe.xadd(stream, entry)
        pipe.xdel(keys.dead_letters, dead_id)
        new_id, _ = await pipe.execute()
    return {"id": dead_id, "stream": stream, "new_entry_id": new_id.decode()}
