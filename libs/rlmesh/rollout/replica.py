"""One rollout replica: its engine, the sampler loop, the registry heartbeat and the Rollout servicer;
its life (join, claim, generate, score, publish, leave) is in docs/design.md#rollout-replica, its
Redis entries are signed with the run's keys (docs/security.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import redis.asyncio as aioredis

from rlmesh.config import RLMeshConfig
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.queue import ReplicaRegistry, RunKeys, connect, prompt_queue, trajectory_queue
from rlmesh.queue.partials import PartialStore
from rlmesh.queue.policy import PolicyState, inside_roots, read_policy
from rlmesh.queue.signing import INVALID, UNTRUSTED
from rlmesh.reference.client import ReferenceClient
from rlmesh.reward.client import RewardClient
from rlmesh.rollout.engines import RunningEngine, engine_http_args, sglang_rollout_args, start_engine
from rlmesh.rollout.gpu_slots import GpuClaim, claim_gpus, visible_gpu_uuids
from rlmesh.rollout.resilience import CircuitBreaker
from rlmesh.rollout.sampler import SamplerLoop, SamplerSettings, parse_version
from rlmesh.rollout.servicer import RolloutServicer
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.net import advertised_host, bracket
from rlmesh.v1 import trajectory_pb2

log = logging.getLogger("rlmesh.rollout")

# The run's policy version is read from Redis at most this often while a joining replica waits.
POLICY_POLL_S = 1.0


def sampling_defaults(cfg: RLMeshConfig) -> dict:
    """The replica's sampling parameters (verl's rollout keys); a task's own params win."""
    r = cfg.actor_rollout_ref.rollout
    params: dict = {
        "max_new_tokens": r.response_length,
        "temperature": r.temperature if r.do_sample else 0.0,
        "top_p": r.top_p,
        "ignore_eos": r.ignore_eos,
    }
    if r.top_k > 0:
        params["top_k"] = r.top_k
    return params


def sampler_settings(cfg: RLMeshConfig, replica_id: str) -> SamplerSettings:
    s = cfg.rlmesh.sampler
    return SamplerSettings(
        replica_id=replica_id,
        tasks_in_flight=s.tasks_in_flight,
        claim_block_ms=s.claim_block_ms,
        touch_interval_s=cfg.rlmesh.queue.claim_idle_ms / 3000,
        backoff_s=s.retry_backoff_s,
        max_backoff_s=s.retry_max_backoff_s,
        sampling_defaults=sampling_defaults(cfg),
        partial_chunk_tokens=s.partial_chunk_tokens,
    )


def sglang_extra_args(cfg: RLMeshConfig) -> list[str]:
    """The flags an SGLang replica gets beyond ``sglang_launch_argv``'s own: verl's rollout knobs
    (``sglang_rollout_args``), then the user's ``rollout.sglang.extra_args``, last so they win."""
    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    knobs = sglang_rollout_args(
        enforce_eager=rollout.enforce_eager,
        max_model_len=rollout.max_model_len,
        max_num_seqs=rollout.max_num_seqs,
        max_num_batched_tokens=rollout.max_num_batched_tokens,
        enable_chunked_prefill=rollout.enable_chunked_prefill,
        enable_prefix_caching=rollout.enable_prefix_caching,
        override_config=model.override_config,
        engine_kwargs=rollout.engine_kwargs.get("sglang"),
    )
    return [*knobs, *rollout.sglang.extra_args]


def engine_names(cfg: RLMeshConfig) -> list[str]:
    """The names the learner reaches this replica's engine by: the replica's advertised host, and
    the host of ``rlmesh.sampler.engine_advertise_url``."""
    rollout = cfg.rlmesh.rollout
    names = [
        advertised_host(
            rollout.host,
            advertise=rollout.advertise_address,
            key="rlmesh.rollout.advertise_address",
            redis_url=cfg.rlmesh.redis_url,
        )
    ]
    if cfg.rlmesh.sampler.engine_advertise_url:
        names.append(urlsplit(cfg.rlmesh.sampler.engine_advertise_url).hostname or "")
    return [n for n in names if n]


async def start_replica_engine(
    cfg: RLMeshConfig, launcher: ProcessLauncher, replica_id: str, gpus: list[str] | None = None
) -> RunningEngine:
    """The engine binds the replica's own bind host, so a learner elsewhere reaches it when the
    replica does (docs/design.md#addresses); ``gpus``: the ones it claimed (gpu_slots)."""
    rollout, sampler = cfg.actor_rollout_ref.rollout, cfg.rlmesh.sampler
    model = cfg.actor_rollout_ref.model
    return await start_engine(
        kind=rollout.name,
        model_path=cfg.actor_rollout_ref.model.path,
        launcher=launcher,
        name=replica_id,
        attach_urls=rollout.sglang.url,
        max_batch_size=sampler.engine_max_batch_size,
        startup_timeout_s=sampler.engine_startup_timeout_s,
        request_timeout_s=max(600.0, cfg.rlmesh.rollout.timeout_s),
        port=sampler.engine_port,
        host=cfg.rlmesh.rollout.host,
        tp_size=rollout.tensor_model_parallel_size if rollout.name == "sglang" else 1,
        mem_fraction_static=rollout.gpu_memory_utilization,
        dtype=rollout.dtype,
        extra_args=sglang_extra_args(cfg),
        skip_tokenizer_init=rollout.skip_tokenizer_init,
        token=cfg.rlmesh.token(),
        override_config=model.override_config,
        gpus=gpus,
        allow_open_bind=cfg.rlmesh.security.allow_open_bind,
        http_args=engine_http_args(cfg.rlmesh.security, engine_names(cfg)),
    )


def weights_roots(cfg: RLMeshConfig) -> list[str]:
    """The directories a policy record may point a joining replica into: the learner's checkpoints
    (``trainer.default_local_dir``) and the disk transport's ``rlmesh.weight_sync.disk_dir``."""
    roots = [cfg.trainer.default_local_dir]
    if cfg.rlmesh.weight_sync.disk_dir:
        roots.append(cfg.rlmesh.weight_sync.disk_dir)
    return roots


async def weights_to_join(
    redis: aioredis.Redis, keys: RunKeys, roots: list[str], held_version: int
) -> PolicyState | None:
    """The run's policy record when a replica holding ``held_version`` should load its disk snapshot
    before taking work: newer, signed (``read_policy``), and inside ``roots``. None otherwise: the
    learner's next push brings the replica up instead."""
    policy = await read_policy(redis, keys)
    if policy.version <= held_version or not policy.disk_path:
        return None
    if not inside_roots(policy.disk_path, roots):
        UNTRUSTED.count("policy", INVALID, f"weights at {policy.disk_path!r}, outside the run's {roots}")
        return None
    return policy


async def claim_replica_gpus(cfg: RLMeshConfig, redis: aioredis.Redis, keys: RunKeys) -> GpuClaim | None:
    """With ``rlmesh.placement.claim_gpus``, an SGLang replica that starts its server takes a slot of
    tensor_model_parallel_size of the GPUs it sees (``gpu_slots.claim_gpus``); else None."""
    rollout = cfg.actor_rollout_ref.rollout
    if not cfg.rlmesh.placement.claim_gpus or rollout.name != "sglang" or rollout.sglang.url:
        return None
    uuids = await asyncio.to_thread(visible_gpu_uuids)
    claim = await claim_gpus(
        redis, keys, uuids, rollout.tensor_model_parallel_size, cfg.rlmesh.queue.heartbeat_ttl_s
    )
    log.info("claimed GPUs %s of the %d this replica sees", ",".join(claim.gpus), len(uuids))
    return claim


class RolloutReplica:
    """Built by ``create``; ``start`` registers and runs it, ``stop`` gives unfinished work back.

    ``on_lost(why)`` is called once when the replica cannot go on (its engine died or its sampler
    loop failed): the service then stops serving and exits non-zero for its supervisor."""

    def __init__(
        self,
        cfg: RLMeshConfig,
        *,
        replica_id: str,
        redis: object,
        launcher: ProcessLauncher,
        engine: RunningEngine,
        reward: RewardClient,
        reference: ReferenceClient | None,
        sampler: SamplerLoop,
        on_lost: Callable[[str], Awaitable[None]],
        gpu_claim: GpuClaim | None = None,
    ) -> None:
        self.cfg = cfg
        self.gpu_claim = gpu_claim  # held while its SGLang runs on the GPUs it claimed
        self.replica_id = replica_id
        self.keys = RunKeys.signed(cfg.rlmesh.run_id, cfg.rlmesh.token())
        self.redis = redis
        self.launcher = launcher
        self.engine = engine
        self.reward = reward
        self.reference = reference
        self.sampler = sampler
        self.on_lost = on_lost
        self.registry = ReplicaRegistry(redis, self.keys, ttl_s=cfg.rlmesh.queue.heartbeat_ttl_s)
        self.servicer = RolloutServicer(
            replica_id=replica_id,
            engine_kind=engine.kind,
            engine=engine.client,
            sampler=sampler,
            capacity=sampler.settings.tasks_in_flight,
            sampling_defaults=sampler.settings.sampling_defaults,
            on_drained=self.deregister,
        )
        self.grpc_address = ""
        rollout = cfg.rlmesh.rollout
        self.advertise_host = advertised_host(
            rollout.host,
            advertise=rollout.advertise_address,
            key="rlmesh.rollout.advertise_address",
            redis_url=cfg.rlmesh.redis_url,
        )
        self.engine_lost = ""  # why the engine is gone; then this replica ends
        self._run_version = 0
        self._run_version_read_at = float("-inf")
        self._background: list[asyncio.Task[None]] = []
        sampler.can_claim = self.caught_up

    @classmethod
    async def create(
        cls, cfg: RLMeshConfig, *, metrics_registry: object, on_lost: Callable[[str], Awaitable[None]]
    ) -> RolloutReplica:
        """Starts (or attaches) the engine and loads the run's current weights into it when the
        run is past them (a replica joining mid-run), before anything is claimed."""
        if not cfg.rlmesh.run_id:
            raise ValueError("rlmesh.run_id is required: replicas of one run share its queues")
        s = cfg.rlmesh.sampler
        replica_id = s.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        keys = RunKeys.signed(cfg.rlmesh.run_id, cfg.rlmesh.token())
        redis = connect(cfg.rlmesh.redis_url)
        launcher = ProcessLauncher(stop_grace_s=cfg.rlmesh.runtime.shutdown_grace_s)
        gpu_claim = await claim_replica_gpus(cfg, redis, keys)
        # While the engine starts: the tokenizer takes seconds too (transformers imports torch).
        tokenizer_load = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, cfg.tokenizer_path()))
        try:
            engine = await start_replica_engine(cfg, launcher, replica_id, gpu_claim and gpu_claim.gpus)
        except BaseException:
            tokenizer_load.cancel()
            if gpu_claim is not None:
                await gpu_claim.release()
            raise
        reward = RewardClient.from_config(cfg, redis=redis)
        # A colocated reference is the learner's: no service to call, trajectories carry none.
        colocated = cfg.rlmesh.reference.colocated
        reference = ReferenceClient.from_config(cfg) if cfg.uses_reference() and not colocated else None
        settings = sampler_settings(cfg, replica_id)
        queue_kw = {
            "max_deliveries": cfg.rlmesh.queue.max_deliveries,
            "claim_idle_ms": cfg.rlmesh.queue.claim_idle_ms,
        }
        tokenizer = await tokenizer_load
        sampler = SamplerLoop(
            prompts=prompt_queue(
                redis, keys, replica_id, maxlen=cfg.rlmesh.queue.prompt_stream_maxlen, **queue_kw
            ),
            trajectories=trajectory_queue(
                redis, keys, replica_id, maxlen=cfg.rlmesh.queue.trajectory_stream_maxlen, **queue_kw
            ),
            engine=engine.client,
            score=reward.score,
            ref_logprobs=reference.log_probs if reference else None,
            settings=settings,
            reward_breaker=CircuitBreaker("reward", s.breaker_failures, s.breaker_reset_s),
            reference_breaker=CircuitBreaker("reference", s.breaker_failures, s.breaker_reset_s),
            engine_breaker=CircuitBreaker("engine", s.breaker_failures, s.breaker_reset_s),
            registry=metrics_registry,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            partials=PartialStore(redis, keys) if s.partial_chunk_tokens else None,
        )
        replica = cls(
            cfg,
            replica_id=replica_id,
            redis=redis,
            launcher=launcher,
            engine=engine,
            reward=reward,
            reference=reference,
            sampler=sampler,
            on_lost=on_lost,
            gpu_claim=gpu_claim,
        )
        await replica.load_run_weights()
        return replica

    async def load_run_weights(self) -> None:
        client = self.engine.client
        self.sampler.policy_version = parse_version((await client.model_info()).get("weight_version"))
        policy = await weights_to_join(
            self.redis,  # type: ignore[arg-type]
            self.keys,
            weights_roots(self.cfg),
            self.sampler.policy_version,
        )
        if policy is not None:
            log.info("joining at policy version %d: loading %s", policy.version, policy.disk_path)
            await client.update_weights_from_disk(policy.disk_path, str(policy.version))
            self.sampler.policy_version = policy.version

    async def caught_up(self) -> bool:
        """Claim only with the run's current weights: a replica joining mid-run waits for them."""
        if time.monotonic() - self._run_version_read_at > POLICY_POLL_S:
            with contextlib.suppress(Exception):
                self._run_version = (await read_policy(self.redis, self.keys)).version
                self._run_version_read_at = time.monotonic()
        return self.sampler.policy_version >= self._run_version

    def registration(self) -> trajectory_pb2.ReplicaRegistration:
        s = self.cfg.rlmesh.sampler
        return trajectory_pb2.ReplicaRegistration(
            replica_id=self.replica_id,
            grpc_address=self.grpc_address,
            engine_url=s.engine_advertise_url or self.engine_url(),
            engine=self.engine.kind,
            policy_version=self.sampler.policy_version,
            capacity=self.sampler.settings.tasks_in_flight,
            weight_sync_ranks=self.engine.weight_sync_ranks,
            engine_device=self.engine.device,
            state=self.servicer.current_state(),
        )

    def engine_url(self) -> str:
        """The engine's URL for the learner: on the advertised host when this replica started it;
        an engine it attached to keeps the URL it was given."""
        if self.engine.process is None:
            return self.engine.url
        port = urlsplit(self.engine.url).port
        return f"{urlsplit(self.engine.url).scheme}://{bracket(self.advertise_host)}:{port}"

    async def start(self, grpc_address: str) -> None:
        """``grpc_address``: what peers dial for its Rollout service (the service's advertised address)."""
        self.grpc_address = grpc_address
        await self.registry.register(self.registration())  # registered before "serving" is announced
        self._background.append(asyncio.create_task(self._heartbeat()))
        self._background.append(asyncio.create_task(self._run_sampler()))

    async def deregister(self) -> None:
        with contextlib.suppress(Exception):
            await self.registry.deregister(self.replica_id)

    async def _leave(self, why: str) -> None:
        # Nothing here can repair it: leave the registry (no more pushes or work for us) and let
        # the service exit non-zero, so the supervisor starts a new replica.
        log.error("%s: leaving the run; in-flight tasks go back to the queue", why)
        await self.on_lost(why)
        await self.deregister()

    async def _lose_engine(self, why: str) -> None:
        self.engine_lost = why
        await self._leave(f"engine lost ({why})")

    async def _run_sampler(self) -> None:
        # Transient Redis errors are retried inside; anything else (NOGROUP after a Redis restart
        # without persistence, MISCONF on a full disk, a bug) would leave a replica that heartbeats
        # as SERVING and claims nothing.
        try:
            await self.sampler.run()
        except Exception as e:
            log.exception("the sampler loop failed")
            await self._leave(f"sampler loop failed: {type(e).__name__}: {e}")

    async def _heartbeat(self) -> None:
        # The engine is the truth about its weights (the learner pushes to it directly).
        lost_after_s = self.cfg.rlmesh.sampler.engine_lost_after_s
        process = self.engine.process
        unreachable_since: float | None = None
        while not self.engine_lost:
            if process is not None and not process.alive():
                code = process.popen.returncode
                await self._lose_engine(f"its process exited with code {code}; log {process.log_path}")
                return
            try:
                info = await self.engine.client.model_info()
                version = parse_version(info.get("weight_version"))
                self.sampler.policy_version = max(self.sampler.policy_version, version)
                unreachable_since = None
            except Exception as e:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > lost_after_s:
                    await self._lose_engine(f"unreachable for {lost_after_s:.0f} s: {e}")
                    return
            if self.servicer.state != "draining":
                with contextlib.suppress(Exception):
                    await self.registry.register(self.registration())
            await asyncio.sleep(min(self.registry.ttl_ms / 3000, 1.0))

    async def stop(self) -> None:
        # Without an engine nothing in flight can finish: give it all back at once.
        grace_s = 0.0 if self.engine_lost else self.cfg.rlmesh.runtime.shutdown_grace_s
        unfinished = await self.sampler.stop(grace_s)
        if unfinished:
            log.warning("%d task(s) unfinished at shutdown; given back to the queue", unfinished)
        for task in self._background:
            task.cancel()
        await self.deregister()
        await self.reward.close()
        if self.reference:
            await self.reference.close()
        await self.engine.client.aclose()
        await asyncio.to_thread(self.launcher.stop_all)
        if self.gpu_claim is not None:  # its SGLang is gone: the GPUs are free for another replica
            with contextlib.suppress(Exception):
                await self.gpu_claim.release()
        await self.redis.aclose()  # type: ignore[attr-defined]
