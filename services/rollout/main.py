"""Rollout service: turns prompt tasks into scored trajectories with an SGLang-API engine.

One replica = this process + its engine (the embedded engine as a child process, or an SGLang
server launched or attached). It registers in the run's replica registry with a heartbeat,
loads the run's current weights before it claims work when it joins mid-run, runs the sampler
loop, and serves ``rlmesh.v1.Rollout``. On SIGTERM it stops claiming, finishes in-flight tasks
within the grace period (the rest go back to the queue for other replicas), deregisters and stops
its engine. If the engine dies it does the same at once and exits 3, for its supervisor to restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence

from rlmesh.config import RLMeshConfig
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.queue import ReplicaRegistry, RunKeys, connect, prompt_queue, trajectory_queue
from rlmesh.queue.policy import read_policy
from rlmesh.reference.client import ReferenceClient
from rlmesh.reward.client import RewardClient
from rlmesh.rollout.engines import start_engine
from rlmesh.rollout.resilience import CircuitBreaker
from rlmesh.rollout.sampler import SamplerLoop, SamplerSettings, parse_version
from rlmesh.runtime.entry import service_main
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc, trajectory_pb2
from rlmesh_services.rollout.servicer import RolloutServicer

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
log = logging.getLogger("rlmesh.rollout")


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


async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
    if not cfg.rlmesh.run_id:
        raise ValueError("rlmesh.run_id is required: replicas of one run share its queues")
    sampler_cfg = cfg.rlmesh.sampler
    rollout_cfg = cfg.actor_rollout_ref.rollout
    replica_id = sampler_cfg.replica_id or f"{socket.gethostname()}-{os.getpid()}"
    keys = RunKeys(cfg.rlmesh.run_id)
    redis = connect(cfg.rlmesh.redis_url)
    launcher = ProcessLauncher(stop_grace_s=cfg.rlmesh.runtime.shutdown_grace_s)
    engine = await start_engine(
        kind=rollout_cfg.name,
        model_path=cfg.actor_rollout_ref.model.path,
        launcher=launcher,
        name=replica_id,
        attach_urls=rollout_cfg.sglang.url,
        max_batch_size=sampler_cfg.engine_max_batch_size,
        startup_timeout_s=sampler_cfg.engine_startup_timeout_s,
        request_timeout_s=max(600.0, cfg.rlmesh.rollout.timeout_s),
        port=sampler_cfg.engine_port,
        tp_size=rollout_cfg.tensor_model_parallel_size if rollout_cfg.name == "sglang" else 1,
        mem_fraction_static=rollout_cfg.gpu_memory_utilization,
        dtype=rollout_cfg.dtype,
        extra_args=rollout_cfg.sglang.extra_args,
        skip_tokenizer_init=rollout_cfg.skip_tokenizer_init,
    )
    reward = RewardClient.from_config(cfg, redis=redis)
    reference = ReferenceClient.from_config(cfg) if cfg.uses_reference() else None
    settings = SamplerSettings(
        replica_id=replica_id,
        tasks_in_flight=sampler_cfg.tasks_in_flight,
        claim_block_ms=sampler_cfg.claim_block_ms,
        touch_interval_s=cfg.rlmesh.queue.claim_idle_ms / 3000,
        backoff_s=sampler_cfg.retry_backoff_s,
        max_backoff_s=sampler_cfg.retry_max_backoff_s,
        sampling_defaults=sampling_defaults(cfg),
    )
    queue_kw = {
        "max_deliveries": cfg.rlmesh.queue.max_deliveries,
        "claim_idle_ms": cfg.rlmesh.queue.claim_idle_ms,
    }
    run_version = {"value": 0, "read_at": 0.0}

    async def caught_up() -> bool:
        """Claim only with the run's current weights: a replica joining mid-run waits for them."""
        if time.monotonic() - run_version["read_at"] > 1.0:
            with contextlib.suppress(Exception):
                run_version["value"] = (await read_policy(redis, keys)).version
                run_version["read_at"] = time.monotonic()
        return sampler.policy_version >= run_version["value"]

    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.tokenizer_path())
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
        reward_breaker=CircuitBreaker("reward", sampler_cfg.breaker_failures, sampler_cfg.breaker_reset_s),
        reference_breaker=CircuitBreaker(
            "reference", sampler_cfg.breaker_failures, sampler_cfg.breaker_reset_s
        ),
        engine_breaker=CircuitBreaker("engine", sampler_cfg.breaker_failures, sampler_cfg.breaker_reset_s),
        can_claim=caught_up,
        registry=service.registry,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    sampler.policy_version = parse_version((await engine.client.model_info()).get("weight_version"))
    policy = await read_policy(redis, keys)
    if policy.version > sampler.policy_version and policy.disk_path:
        log.info("joining at policy version %d: loading %s", policy.version, policy.disk_path)
        await engine.client.update_weights_from_disk(policy.disk_path, str(policy.version))
        sampler.policy_version = policy.version

    registry = ReplicaRegistry(redis, keys, ttl_s=cfg.rlmesh.queue.heartbeat_ttl_s)

    async def deregister() -> None:
        with contextlib.suppress(Exception):
            await registry.deregister(replica_id)

    servicer = RolloutServicer(
        replica_id=replica_id,
        engine_kind=engine.kind,
        engine=engine.client,
        sampler=sampler,
        capacity=settings.tasks_in_flight,
        sampling_defaults=settings.sampling_defaults,
        on_drained=deregister,
    )
    service.add_servicer(rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, SERVICE_NAME)

    def registration() -> trajectory_pb2.ReplicaRegistration:
        return trajectory_pb2.ReplicaRegistration(
            replica_id=replica_id,
            grpc_address=cfg.rlmesh.rollout.advertise_address or service.address,
            engine_url=sampler_cfg.engine_advertise_url or engine.url,
            engine=engine.kind,
            policy_version=sampler.policy_version,
            capacity=settings.tasks_in_flight,
            weight_sync_ranks=engine.weight_sync_ranks,
            state=servicer.current_state(),
        )

    engine_lost: list[str] = []  # why the engine is gone; then this replica ends

    async def leave(why: str) -> None:
        # Nothing here can repair it: leave the registry (no more pushes or work for us), give the
        # tasks back and exit non-zero so the supervisor starts a new replica.
        log.error("%s: leaving the run; in-flight tasks go back to the queue", why)
        await service.set_serving(False)
        await deregister()
        service.exit_code = 3
        service.request_stop()

    async def lose_engine(why: str) -> None:
        engine_lost.append(why)
        await leave(f"engine lost ({why})")

    async def run_sampler() -> None:
        # Transient Redis errors are retried inside; anything else (NOGROUP after a Redis restart
        # without persistence, MISCONF on a full disk, a bug) would leave a replica that heartbeats
        # as SERVING and claims nothing.
        try:
            await sampler.run()
        except Exception as e:
            log.exception("the sampler loop failed")
            await leave(f"sampler loop failed: {type(e).__name__}: {e}")

    async def heartbeat() -> None:
        # The engine is the truth about its weights (the learner may push to it directly).
        unreachable_since: float | None = None
        while not engine_lost:
            if engine.process is not None and not engine.process.alive():
                code = engine.process.popen.returncode
                await lose_engine(f"its process exited with code {code}; log {engine.process.log_path}")
                return
            try:
                info = await engine.client.model_info()
                sampler.policy_version = max(
                    sampler.policy_version, parse_version(info.get("weight_version"))
                )
                unreachable_since = None
            except Exception as e:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > sampler_cfg.engine_lost_after_s:
                    await lose_engine(f"unreachable for {sampler_cfg.engine_lost_after_s:.0f} s: {e}")
                    return
            if servicer.state != "draining":
                with contextlib.suppress(Exception):
                    await registry.register(registration())
            await asyncio.sleep(min(registry.ttl_ms / 3000, 1.0))

    background: list[asyncio.Task[None]] = []

    async def start_background() -> None:
        await registry.register(registration())  # registered before the ready file says "serving"
        background.append(asyncio.create_task(heartbeat()))
        background.append(asyncio.create_task(run_sampler()))

    async def shutdown() -> None:
        # Without an engine nothing in flight can finish: give it all back at once.
        unfinished = await sampler.stop(0.0 if engine_lost else cfg.rlmesh.runtime.shutdown_grace_s)
        if unfinished:
            log.warning("%d task(s) unfinished at shutdown; given back to the queue", unfinished)
        for task in background:
            task.cancel()
        await deregister()
        await reward.close()
        if reference:
            await reference.close()
        await engine.client.aclose()
        await asyncio.to_thread(launcher.stop_all)
        await redis.aclose()

    service.on_start(start_background)
    service.on_shutdown(shutdown)


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("rollout", build, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
