"""What rank 0's run is connected to, made once before the first step (``wire_run``) and closed
once after the last (``RunWiring.aclose``): Redis and the run's lease, the queues, the feeder and
collector, the replicas' weight push, the reward client."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rlmesh.config import RLMeshConfig
from rlmesh.config.loader import dump_public_yaml
from rlmesh.data import PromptCursor, RLHFDataset
from rlmesh.learner.ppo.batch import validate_trajectory
from rlmesh.learner.run.collect import BatchCollector
from rlmesh.learner.run.dynamic_sampling import GroupFilter
from rlmesh.learner.run.feeder import PromptFeeder
from rlmesh.learner.run.loop_state import LoopState
from rlmesh.learner.run.policy_push import PolicyPush
from rlmesh.learner.run.recovery import LostGroupRecovery
from rlmesh.learner.run.trainer_thread import RankZero
from rlmesh.learner.weight_sync.push import WeightPusher, weight_master_address
from rlmesh.queue import (
    ReplicaRegistry,
    RunKeys,
    TrajectoryCollector,
    connect,
    prompt_queue,
    retry_redis_with_deadline,
    trajectory_queue,
)
from rlmesh.queue.lease import RunLease
from rlmesh.queue.run_info import publish_config
from rlmesh.reward.client import RewardClient
from rlmesh.reward.failures import RewardErrorRule
from rlmesh.v1 import common_pb2

log = logging.getLogger("rlmesh.learner")

RUN_ENDED = "learner_ended"  # why the run's learner ended it (finished, stopped), set as it lets go


async def mark_run_ended(redis: aioredis.Redis, keys: RunKeys, why: str, ttl_s: int = 0) -> None:
    """Tells a standby waiting on the lease that the run ended by choice, not by a death: it must
    not take it over. A learner started again for the run clears it."""
    try:
        await redis.set(keys.scoped(RUN_ENDED), why, ex=ttl_s if ttl_s > 0 else None)
    except RedisError as e:  # the run's end stands; a standby may resume it and find it ended
        log.warning("could not mark run %s ended (%s) for a standby: %s", keys.run_id, why, e)


class StoppedBeforeLease(Exception):
    """A standby told to stop while it waited on the lease: its run never began."""


@dataclass
class RunWiring:
    redis: aioredis.Redis
    lease: RunLease
    incarnation: int
    feeder: PromptFeeder
    collector: BatchCollector
    recovery: LostGroupRecovery
    push: PolicyPush
    reward: RewardClient
    _closing: contextlib.AsyncExitStack = field(repr=False, default_factory=contextlib.AsyncExitStack)

    async def aclose(self) -> None:
        """The reward client, the engines' links, the lease, then Redis: the reverse of making them."""
        await self._closing.aclose()


def sampling_params(cfg: RLMeshConfig) -> common_pb2.SamplingParams:
    """The sampling the prompt tasks carry (changed live through ``UpdateHyperparams``)."""
    rollout = cfg.actor_rollout_ref.rollout
    sampling = common_pb2.SamplingParams(
        max_new_tokens=rollout.response_length,
        temperature=rollout.temperature if rollout.do_sample else 0.0,
        top_p=rollout.top_p,
    )
    if rollout.top_k > 0:
        sampling.top_k = rollout.top_k
    return sampling


async def wire_run(
    cfg: RLMeshConfig,
    keys: RunKeys,
    *,
    train_set: RLHFDataset,
    cursor: PromptCursor,
    sampling: common_pb2.SamplingParams,
    vocab_size: int | None,
    ref_from_replicas: bool,
    reward_rule: RewardErrorRule,
    rank_zero: RankZero,
    state: LoopState,
    checkpoint_root: Path,
    progress: Callable[[str], None],
) -> RunWiring:
    """Connects rank 0's run: the lease first, then its queues, clients and links. What was made
    before a failure is closed before it propagates (the stack's ``pop_all`` hands the rest over)."""
    async with contextlib.AsyncExitStack() as closing:
        q = cfg.rlmesh.queue
        rollout = cfg.actor_rollout_ref.rollout
        redis = connect(cfg.rlmesh.redis_url)
        closing.push_async_callback(redis.aclose)
        # Before anything else touches the run's keys: a second learner would trim the prompt
        # stream under the first one and consume its trajectories.
        lease = RunLease(redis, keys.scoped("learner_lease"), lease_s=2 * q.heartbeat_ttl_s)
        if cfg.rlmesh.learner.standby:
            state.message = (
                f"standby: model and optimizer built, waiting on the learner lease of run {keys.run_id}"
            )
            progress(state.message)
            if not await lease.acquire(wait_s=math.inf, stopped=lambda: state.stop_requested):
                raise StoppedBeforeLease(f"stopped as a standby of run {keys.run_id}: it never took over")
            ended = await redis.get(keys.scoped(RUN_ENDED))
            if ended is not None:  # the learner ended the run itself and let the lease go
                await lease.release()
                raise StoppedBeforeLease(
                    f"run {keys.run_id} {ended.decode(errors='replace')}: no standby takes it over"
                )
            state.message = ""
            progress(f"standby: took over the learner lease of run {keys.run_id}")
        else:
            progress(f"taking the learner lease of run {keys.run_id}")
            await lease.acquire()
            await redis.delete(keys.scoped(RUN_ENDED))  # started again: the run goes on
        closing.push_async_callback(_release, lease, asyncio.create_task(lease.keep()))
        incarnation = int(await redis.incr(keys.scoped("learner_incarnation")))
        prompts = prompt_queue(
            redis,
            keys,
            "learner",
            maxlen=q.prompt_stream_maxlen,
            max_deliveries=q.max_deliveries,
            claim_idle_ms=q.claim_idle_ms,
        )
        await prompts.ensure_group()
        # Tasks an earlier incarnation queued are regenerated from the restored cursor.
        await redis.xtrim(keys.prompts, maxlen=0)
        trajs = trajectory_queue(
            redis,
            keys,
            "learner-0",
            maxlen=q.trajectory_stream_maxlen,
            max_deliveries=q.max_deliveries,
            claim_idle_ms=q.claim_idle_ms,
        )
        await trajs.ensure_group()
        remax = cfg.algorithm.adv_estimator == "remax"
        feeder = PromptFeeder(
            prompts,
            train_set,
            cursor,
            batch_size=cfg.data.train_batch_size,
            n=rollout.n,
            incarnation=incarnation,
            sampling=sampling,
            greedy_baseline=remax,
            extra=cfg.rlmesh.extra_groups(cfg.data.train_batch_size),
        )
        filter_groups = cfg.algorithm.filter_groups
        collector = BatchCollector(
            TrajectoryCollector(trajs, keys.used_uids),
            n=rollout.n,
            incarnation=incarnation,
            max_staleness=cfg.rlmesh.max_staleness,
            validate=functools.partial(
                validate_trajectory,
                needs_ref=ref_from_replicas,
                needs_baseline=remax,
                vocab_size=vocab_size,
                max_prompt_length=cfg.data.max_prompt_length,
                max_response_length=rollout.response_length,
            ),
            wanted=lambda gid: gid in feeder.outstanding,
            keep_group=GroupFilter(filter_groups.metric) if filter_groups.enable else None,
            rule=reward_rule,
        )
        ws = cfg.rlmesh.weight_sync
        pusher = WeightPusher(
            [],
            master_address=weight_master_address(cfg),
            master_port=ws.master_port,
            timeout_s=ws.timeout_s,
            control_timeout_s=ws.control_timeout_s,
            bucket_bytes=ws.bucket_size_mb << 20,
            load_format=None if ws.load_format == "per_tensor" else ws.load_format,
            verify_tensors=ws.verify_tensors,
            pause_mode=ws.pause_mode,
            group_size=ws.group_size,
        )
        closing.push_async_callback(pusher.close)
        replicas = ReplicaRegistry(redis, keys, ttl_s=q.heartbeat_ttl_s)
        push = PolicyPush(cfg, keys, redis, replicas, pusher, rank_zero, state, checkpoint_root)
        reward = RewardClient.from_config(cfg, redis=redis)
        closing.push_async_callback(reward.close)
        await retry_redis_with_deadline(
            lambda: publish_config(redis, keys, dump_public_yaml(cfg)), "publish the config"
        )
        wiring = RunWiring(
            redis=redis,
            lease=lease,
            incarnation=incarnation,
            feeder=feeder,
            collector=collector,
            recovery=LostGroupRecovery(feeder, collector),
            push=push,
            reward=reward,
            _closing=closing.pop_all(),
        )
    return wiring


async def _release(lease: RunLease, keeper: asyncio.Task[None]) -> None:
    keeper.cancel()
    with contextlib.suppress(Exception):
        await lease.release()
