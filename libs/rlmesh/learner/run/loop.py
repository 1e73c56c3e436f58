"""The learner's run loop (rank 0 drives, other ranks follow): one PPO step at a time.

docs/design.md#one-ppo-step-as-data"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
import torch

from rlmesh.algo import get_kl_controller
from rlmesh.config import RLMeshConfig
from rlmesh.config.loader import dump_public_yaml
from rlmesh.data import PromptCursor, RLHFDataset
from rlmesh.data.cursor import total_training_steps
from rlmesh.engine.client import EngineClient, engine_device_of
from rlmesh.learner.checkpoints.store import latest_checkpoint, replace_dir
from rlmesh.learner.ppo.batch import validate_trajectory
from rlmesh.learner.ppo.model_loading import first_policy_version
from rlmesh.learner.run.collect import BatchCollector, StepBatch
from rlmesh.learner.run.commands import Followers, RankCommand, run_collective
from rlmesh.learner.run.dynamic_sampling import GenBatches, GroupFilter, draw_in_place
from rlmesh.learner.run.feeder import PromptFeeder, index_of
from rlmesh.learner.run.recovery import LostGroupRecovery
from rlmesh.learner.run.sinks import JSONL_ONLY_PREFIXES, MetricsSinks
from rlmesh.learner.run.validation import run_validation, select_generations, val_sampling
from rlmesh.learner.weight_sync.links import weight_sync_backend
from rlmesh.learner.weight_sync.push import WeightPusher, WeightPushError, weight_master_address
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.queue import (
    ReplicaRegistry,
    RunKeys,
    TrajectoryCollector,
    connect,
    prompt_queue,
    retry_redis_with_deadline,
    trajectory_queue,
)
from rlmesh.queue.connection import TRANSIENT_ERRORS
from rlmesh.queue.lease import RunLease
from rlmesh.queue.policy import publish_policy
from rlmesh.queue.retention import expire_run_keys
from rlmesh.queue.run_info import publish_config, publish_step_metrics
from rlmesh.queue.signing import expose_untrusted
from rlmesh.reward.client import RewardClient
from rlmesh.reward.failures import FailureTally, RewardErrorRule
from rlmesh.v1 import common_pb2, trajectory_pb2

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from rlmesh.learner.trainer import PPOTrainer

log = logging.getLogger("rlmesh.learner")
# How long the learner waits for an unreachable Redis before the run fails.
REDIS_DEADLINE_S = 300.0

PHASES = (
    "STARTING",
    "VALIDATING",
    "WAITING_FOR_ROLLOUTS",
    "TRAINING",
    "PUSHING_WEIGHTS",
    "CHECKPOINTING",
    "PAUSED",
    "STOPPING",
    "FINISHED",
    "FAILED",
)


# Who paused the run (``LoopState.paused_by``), as the learner's message names it.
START_PAUSED = "start_paused"
PAUSE_REQUEST = "pause_request"
PAUSED_MESSAGES = {
    START_PAUSED: "paused since start (rlmesh.learner.start_paused=true): `rlmesh ctl resume` starts training",
    PAUSE_REQUEST: "paused from the control plane (rlmesh ctl pause): `rlmesh ctl resume` goes on",
}


@dataclass
class LoopState:
    step: int = 0
    total_steps: int = 0
    version: int = 0
    phase: str = "STARTING"
    paused: bool = False
    paused_by: str = ""  # START_PAUSED or PAUSE_REQUEST while paused, else ""
    stop_requested: bool = False
    stop_checkpoint: bool = True
    last_metrics: dict[str, float] = field(default_factory=dict)
    last_checkpoint: str = ""
    live_replicas: int = 0
    message: str = ""
    pending_hparams: dict[str, float] = field(default_factory=dict)
    # The last step whose hyper-parameters were taken (mid-step, before its training): a change
    # made after that applies from the step after it.
    hparams_step: int = 0
    checkpoint_requests: list[tuple[str, asyncio.Future[str]]] = field(default_factory=list)

    def pause(self, by: str = PAUSE_REQUEST) -> None:
        """Holds at the next step boundary; a pause already under way keeps who made it."""
        if not self.paused:
            self.paused, self.paused_by = True, by

    def resume(self) -> None:
        self.paused, self.paused_by = False, ""

    @property
    def paused_message(self) -> str:
        """What the learner says while it holds paused: who paused it and how it goes on."""
        return PAUSED_MESSAGES.get(self.paused_by, "paused")


class _StoppedWhileWaiting(Exception):
    """A stop was requested while the loop waited for a batch that did not come: a clean stop."""


def job_gpus(cfg: RLMeshConfig, cuda: bool) -> int:
    """The GPUs this job's config starts, perf/throughput's divisor as verl's n_gpus: the learner's
    ranks on CUDA plus each SGLang replica's tensor-parallel GPUs; 1 when it starts none."""
    learner = cfg.rlmesh.learner.ranks if cuda and cfg.trainer.device != "cpu" else 0
    rollout = cfg.actor_rollout_ref.rollout
    replicas = (
        cfg.rlmesh.rollout.replicas * rollout.tensor_model_parallel_size if rollout.name == "sglang" else 0
    )
    return max(1, learner + replicas)


def timing_per_token_ms(metrics: dict[str, float], response_tokens: int, tokens: int) -> dict[str, float]:
    """verl's ``timing_per_token_ms/<phase>``: gen per response token, the learner's phases per
    prompt + response token (0 when there are none)."""
    per = {
        "gen": response_tokens,
        **dict.fromkeys(("ref", "values", "adv", "update_critic", "update_actor"), tokens),
    }
    return {
        f"timing_per_token_ms/{name}": metrics[f"timing_s/{name}"] * 1000 / n if n > 0 else 0.0
        for name, n in per.items()
        if f"timing_s/{name}" in metrics
    }


class TrainingLoop:
    def __init__(
        self,
        cfg: RLMeshConfig,
        make_trainer: Callable[[RLMeshConfig, int], PPOTrainer],
        *,
        registry: CollectorRegistry | None = None,
        progress: Callable[[str], None] | None = None,
        follower: bool = False,
    ) -> None:
        self.cfg = cfg
        start_paused = cfg.rlmesh.learner.start_paused
        self.state = LoopState(paused=start_paused, paused_by=START_PAUSED if start_paused else "")
        # Signed with a key from the token: what it reads from Redis is checked (docs/security.md).
        self.keys = RunKeys.signed(cfg.rlmesh.run_id or "default", cfg.rlmesh.token())
        if registry is not None:
            expose_untrusted(registry)
        self.tokenizer = load_tokenizer(
            cfg.tokenizer_path(), chat_template=cfg.actor_rollout_ref.model.custom_chat_template
        )
        self.train_set = RLHFDataset.from_config(cfg.data, self.tokenizer, split="train")
        self.val_set = (
            RLHFDataset.from_config(cfg.data, self.tokenizer, split="val") if cfg.data.val_files else None
        )
        self.cursor = PromptCursor.from_config(cfg.data, self.train_set)
        self.state.total_steps = total_training_steps(cfg, len(self.train_set))
        self.trainer = make_trainer(cfg, self.state.total_steps)
        self.kl_ctrl = get_kl_controller(cfg.algorithm.kl_ctrl)
        self.followers = Followers()
        self.registry_metrics = registry
        self.progress = progress or (lambda msg: log.info(msg))
        out_dir = Path(cfg.trainer.default_local_dir)
        self.checkpoint_root = out_dir
        self.sinks = MetricsSinks(
            [] if follower else cfg.trainer.logger,
            jsonl_path=None if follower else out_dir / "metrics.jsonl",
            registry=registry,
            project=cfg.trainer.project_name,
            experiment=cfg.trainer.experiment_name,
            # wandb and mlflow keep the resolved config (the sinks mask its secrets).
            config=None if follower else cfg.model_dump(mode="json"),
            run_dir=out_dir,
        )
        # Uids of the last max_staleness + 2 committed steps: the used set in Redis holds these
        # only. A copy of an older step's sample cannot be taken anyway (its group is no longer
        # outstanding, or of an older incarnation), so the set does not grow with the run.
        self.used_window: deque[list[str]] = deque()
        # What each committed step trained on, one line per step (a resumed run appends the steps
        # it redoes again: the last line of a step counts). The chaos tests audit runs with it.
        self.groups_path = None if follower else out_dir / "trained_groups.jsonl"
        self._redis: aioredis.Redis | None = None
        self.follower = follower
        # Temperatures set live, each with the first step whose prompts were queued with it: the
        # learner scores a step's samples at the temperature that generated them.
        self._temperature_from: list[tuple[int, float]] = []
        # Made by _connect (rank 0 only).
        self.lease: RunLease | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self.feeder: PromptFeeder | None = None
        self.pusher: WeightPusher | None = None
        self.reward: RewardClient | None = None
        # Whether the trajectories must carry the reference log-probs (the service's, through the
        # replicas). A colocated reference recomputes them in the trainer: whatever a trajectory
        # carries (a replica of an older config) is ignored.
        self._ref_from_replicas = cfg.uses_reference() and not cfg.rlmesh.reference.colocated
        self.job_gpus = job_gpus(cfg, torch.cuda.is_available())
        # DAPO's dynamic sampling: the prompts each step draws (algorithm.filter_groups).
        self.filter_groups = cfg.algorithm.filter_groups
        self.gen_batches = GenBatches(cfg.data.train_batch_size, self.filter_groups.max_num_gen_batches)
        self.reward_rule = RewardErrorRule.from_config(cfg)
        self._reward_failure_quoted = False  # the run's first failed reward is logged in full, once

    # ----- setup -----
    async def _connect(self) -> None:
        cfg = self.cfg
        q = cfg.rlmesh.queue
        self._redis = redis = connect(cfg.rlmesh.redis_url)
        # Before anything else touches the run's keys: a second learner would trim the prompt
        # stream under the first one and consume its trajectories.
        self.lease = RunLease(redis, self.keys.scoped("learner_lease"), lease_s=2 * q.heartbeat_ttl_s)
        self.progress(f"taking the learner lease of run {self.keys.run_id}")
        await self.lease.acquire()
        self._lease_task = asyncio.create_task(self.lease.keep())
        self.incarnation = int(await redis.incr(self.keys.scoped("learner_incarnation")))
        prompts = prompt_queue(
            redis,
            self.keys,
            "learner",
            maxlen=q.prompt_stream_maxlen,
            max_deliveries=q.max_deliveries,
            claim_idle_ms=q.claim_idle_ms,
        )
        await prompts.ensure_group()
        # Tasks an earlier incarnation queued are regenerated from the restored cursor.
        await redis.xtrim(self.keys.prompts, maxlen=0)
        trajs = trajectory_queue(
            redis,
            self.keys,
            "learner-0",
            maxlen=q.trajectory_stream_maxlen,
            max_deliveries=q.max_deliveries,
            claim_idle_ms=q.claim_idle_ms,
        )
        await trajs.ensure_group()
        rollout = cfg.actor_rollout_ref.rollout
        sampling = common_pb2.SamplingParams(
            max_new_tokens=rollout.response_length,
            temperature=rollout.temperature if rollout.do_sample else 0.0,
            top_p=rollout.top_p,
        )
        if rollout.top_k > 0:
            sampling.top_k = rollout.top_k
        self.feeder = PromptFeeder(
            prompts,
            self.train_set,
            self.cursor,
            batch_size=cfg.data.train_batch_size,
            n=rollout.n,
            incarnation=self.incarnation,
            sampling=sampling,
            greedy_baseline=cfg.algorithm.adv_estimator == "remax",
        )
        self.collector = BatchCollector(
            TrajectoryCollector(trajs, self.keys.used_uids),
            n=rollout.n,
            incarnation=self.incarnation,
            max_staleness=cfg.rlmesh.max_staleness,
            validate=functools.partial(
                validate_trajectory,
                needs_ref=self._ref_from_replicas,
                needs_baseline=cfg.algorithm.adv_estimator == "remax",
                vocab_size=getattr(self.trainer, "vocab_size", None),
                max_prompt_length=cfg.data.max_prompt_length,
                max_response_length=cfg.actor_rollout_ref.rollout.response_length,
            ),
            wanted=lambda gid: gid in self.feeder.outstanding,
            keep_group=GroupFilter(self.filter_groups.metric) if self.filter_groups.enable else None,
            rule=self.reward_rule,
        )
        self.recovery = LostGroupRecovery(self.feeder, self.collector)
        self.replicas = ReplicaRegistry(redis, self.keys, ttl_s=q.heartbeat_ttl_s)
        ws = cfg.rlmesh.weight_sync
        # Where the trainer's weights are, as dist.learner_device settles trainer.device.
        self.trainer_device = "cuda" if cfg.trainer.device == "cuda" and torch.cuda.is_available() else "cpu"
        self.push_counts: dict[str, float] = {}  # the last push's engines: a step's weight_sync/*
        self.pusher = WeightPusher(
            [],
            master_address=weight_master_address(cfg),
            master_port=ws.master_port,
            timeout_s=ws.timeout_s,
            control_timeout_s=ws.control_timeout_s,
            bucket_bytes=ws.bucket_size_mb << 20,
            load_format=None if ws.load_format == "per_tensor" else ws.load_format,
            verify_tensors=ws.verify_tensors,
        )
        self.reward = RewardClient.from_config(cfg, redis=redis)
        await retry_redis_with_deadline(
            lambda: publish_config(redis, self.keys, dump_public_yaml(cfg)), "publish the config"
        )

    def _resume(self) -> None:
        mode = self.cfg.trainer.resume_mode
        path = None
        if mode == "auto":
            path = latest_checkpoint(str(self.checkpoint_root))
        elif mode == "resume_path":
            path = self.cfg.trainer.resume_from_path
        if not path:
            self.progress("starting fresh (no checkpoint to resume)")
            return
        self.state.phase = "STARTING"
        self.progress(f"resuming from {path}")
        extra = self._collective(RankCommand("load", path=path))
        self.state.step = int(extra["step"])
        self.state.version = int(extra["version"])
        self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        self.cursor.load_state_dict(extra["data_cursor"])
        self.used_window = deque([list(extra.get("used_uids", []))])
        sampling = extra.get("sampling") or {}  # set live before the checkpoint (older ones: none)
        for name in ("temperature", "top_p"):
            if name in sampling:
                setattr(self.feeder.sampling, name, float(sampling[name]))
        self.state.last_checkpoint = path

    # ----- collectives: rank 0 announces, then runs its own part -----
    def _collective(self, command: RankCommand) -> Any:
        self.followers.announce(command)
        result = run_collective(self.trainer, command)
        self.followers.done()  # not reached when rank 0's part raised: see Followers.finish
        return result

    def _weight_buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        command = RankCommand("push", bucket_bytes=self.cfg.rlmesh.weight_sync.bucket_size_mb << 20)
        self.followers.announce(command)
        # No copy: the pusher is done with each bucket (copied into its flat buffer, or sent)
        # before it asks for the next, and no optimizer step runs during a push.
        yield from run_collective(self.trainer, command)
        self.followers.done()  # an abandoned push leaves the followers' state unknown

    # ----- weight sync -----
    async def _live_engines(self) -> list[trajectory_pb2.ReplicaRegistration]:
        """Live replicas from the registry; the pusher targets exactly their engines."""
        live = [
            r
            for r in await retry_redis_with_deadline(self.replicas.live, "read the replicas")
            if r.state != "draining"
        ]
        self.state.live_replicas = len(live)
        timeout = self.cfg.rlmesh.weight_sync.timeout_s
        token = self.cfg.rlmesh.token()
        known = {link.client.url: link.client for link in self.pusher.links}
        clients = [
            known.get(r.engine_url.rstrip("/"))
            # The config's token, not only the one the service exported: a loop built as a library.
            or EngineClient(r.engine_url, name=r.replica_id, timeout_s=timeout, token=token)
            for r in live
        ]
        # An SGLang engine's TP workers each join its weight group (an older registry entry: 0).
        ranks = [max(1, r.weight_sync_ranks) for r in live]
        backends = [
            weight_sync_backend(
                self.cfg.rlmesh.weight_sync.backend,
                self.trainer_device,
                r.engine_device or engine_device_of(r.engine, {}),  # an older replica names none
            )
            for r in live
        ]
        for unused in self.pusher.set_engines(clients, ranks, backends):
            await unused.aclose()
        return live

    async def push_weights(self, only_behind: bool = False) -> float:
        """Pushes the current weights as ``state.version``; returns seconds. ``only_behind`` pushes
        only to replicas reporting an older version (one that joined while we wait for a batch)."""
        live = await self._live_engines()
        only = None
        if only_behind:
            only = {r.engine_url.rstrip("/") for r in live if r.policy_version < self.state.version}
            if not only:
                return 0.0
        t0 = time.monotonic()
        version = self.state.version
        path = None
        try:
            if self.cfg.rlmesh.weight_sync.transport == "disk":
                path = await asyncio.to_thread(self._export_snapshot, version)
                report = await self.pusher.load_from_disk(path, version, only=only)
            else:
                report = await self.pusher.push_buckets(self._weight_buckets(), version, only=only)
            failed = report.failed
            self.push_counts = {
                "weight_sync/engines": len(report.engines),
                "weight_sync/failed_engines": len(failed),
                "weight_sync/unchecked_engines": len(report.unchecked),
            }
        except WeightPushError as e:
            # No replica took them: each is dead, restarting or cut off. Not the run's end: the
            # live ones get them while the next batch is awaited (only_behind), a dead one leaves
            # the registry, and a restarted one joins behind and is brought up the same way.
            failed = e.failed
            self.push_counts = {
                "weight_sync/engines": 0,
                "weight_sync/failed_engines": len(failed),
                "weight_sync/unchecked_engines": 0,
            }
        for name, why in failed.items():
            log.error("replica %s dropped from the push of v%d: %s", name, version, why)
        await retry_redis_with_deadline(
            lambda: publish_policy(self._redis, self.keys, version, path), "publish the policy"
        )
        return time.monotonic() - t0

    async def _export_actor(self, out_dir: str) -> None:
        """The trained actor as an HF directory at ``out_dir``, from memory, published whole (a
        directory beside it, then a rename). A failure is logged, not raised: the run is trained and
        its checkpoint saved, from which ``rlmesh export`` (or ``rlmesh train``) writes it."""
        out = Path(out_dir).expanduser()
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        self.state.phase = "CHECKPOINTING"  # the phases are the proto's: writing the actor is one
        self.progress(f"writing the actor to {out}")
        try:
            await asyncio.to_thread(self._collective, RankCommand("export", path=str(tmp)))
            replace_dir(tmp, out)
        except Exception as e:
            log.error("could not write the actor to %s: %s", out, e)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        log.info("exported the actor to %s", out)

    def _export_snapshot(self, version: int) -> str:
        root = Path(self.cfg.rlmesh.weight_sync.disk_dir or self.checkpoint_root / "weights")
        path = root / f"v{version}"
        self._collective(
            RankCommand("export", path=str(path))
        )  # collective under ZeRO-3: every rank takes part
        # The previous snapshot stays (a replica may be loading it); older ones go.
        for old in root.glob("v*"):
            if old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)
        return str(path)

    # ----- one step -----
    async def _collect(self, step: int) -> StepBatch:
        cfg = self.cfg

        async def requeue(traj: trajectory_pb2.Trajectory) -> None:
            known = self.feeder.outstanding.get(traj.group_uid)
            if known is None:
                # Already enqueued again (its samples came in over several reads) or replaced:
                # another copy would only duplicate the prompt.
                return
            await self.feeder.requeue(traj.group_uid, known[1], step, self.state.version)

        last_sync = time.monotonic()

        def progress(have: int, want: int) -> None:
            self.state.message = f"step {step}: {have}/{want} prompt groups collected"

        self.gen_batches.start_step()

        async def refill(dropped: list[str]) -> None:
            # DAPO: a new prompt of the data in place of each group whose samples all scored alike.
            await draw_in_place(self.feeder, self.gen_batches, dropped, step, self.state.version)

        unreachable_since: float | None = None
        while True:
            try:
                try:
                    return await self.collector.collect(
                        cfg.data.train_batch_size,
                        self.state.version,
                        timeout_s=5.0,
                        requeue=requeue,
                        on_progress=progress,
                        refill=refill,
                        step=step,
                    )
                except TimeoutError:  # the builtin one: nothing complete yet
                    pass
                # A replica may have joined behind our version; bring it up.
                if time.monotonic() - last_sync > 5:
                    await self.push_weights(only_behind=True)
                    last_sync = time.monotonic()
                if self.state.stop_requested:
                    raise _StoppedWhileWaiting from None
                await self.recovery.check(self.state.version)
                unreachable_since = None
            except TRANSIENT_ERRORS as e:
                # Redis away (restarting from its append-only file, or cut off): wait for it. What
                # this round had claimed stays pending and is taken back as orphaned.
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > REDIS_DEADLINE_S:
                    raise
                log.warning("step %d: Redis unavailable while collecting (%s); retrying", step, e)
                await asyncio.sleep(1.0)

    async def run(self) -> None:
        cfg = self.cfg
        failure = ""
        try:
            await self._connect()
            self._resume()
            if self.state.step == 0:  # an engine that has not had the push below takes no work
                self.state.version = first_policy_version(cfg.actor_rollout_ref.model.lora_adapter_path)
            self.state.phase = "PUSHING_WEIGHTS"
            self.progress(
                f"run {self.keys.run_id}: {self.state.total_steps} steps, waiting for rollout replicas"
            )
            await self._wait_for_replicas()
            if not self.state.stop_requested:
                await self.push_weights()
                if cfg.trainer.val_only:
                    # verl validates only when val_before_train is also set; here val_only is enough.
                    await self._validate(self.state.step, log=True)
                    self.progress(
                        f"trainer.val_only: validated the policy of step {self.state.step}, no training"
                    )
                    return
                if cfg.trainer.val_before_train and self.val_set is not None and self.state.step == 0:
                    await self._validate(0, log=True)
            try:
                while self.state.step < self.state.total_steps and not self.state.stop_requested:
                    await self._hold_while_paused()
                    if self.state.stop_requested:  # stopped while paused: no step after the stop
                        break
                    await self._step()
            except _StoppedWhileWaiting:
                self.progress(f"stopped while waiting for the batch of step {self.state.step + 1}")
            # Not after a failure: the trainer may be half-way through a step (and under several
            # ranks the others may still be inside a collective); the last checkpoint stands.
            if self.state.stop_requested and self.state.stop_checkpoint and self.state.step > 0:
                await self._checkpoint(self.state.step, final=True)
            if self.state.step >= self.state.total_steps and cfg.rlmesh.learner.export_dir:
                await self._export_actor(cfg.rlmesh.learner.export_dir)
            if self.state.step >= self.state.total_steps and self._redis is not None:
                ttl_s = cfg.rlmesh.queue.finished_run_ttl_s
                expiring = await expire_run_keys(self._redis, self.keys, ttl_s)
                if expiring:
                    self.progress(
                        f"run {self.keys.run_id} finished: its {expiring} Redis keys expire in {ttl_s} s"
                    )
        except BaseException as e:
            failure = f"{type(e).__name__}: {e}"
            raise
        finally:
            # Every exit, failures included: the other ranks wait for rank 0's next command.
            self.followers.finish(failure)
            self.sinks.close()
            # Each is None when _connect failed before making it.
            if self.reward is not None:
                await self.reward.close()
            if self.pusher is not None:
                await self.pusher.close()
            if self._lease_task is not None:
                self._lease_task.cancel()
                with contextlib.suppress(Exception):
                    await self.lease.release()
            if self._redis is not None:
                await self._redis.aclose()
            # Last, once nothing here uses the replicas, the reward or Redis any more: `rlmesh
            # train` stops them when it reads this, while this process exits (a failure turns it
            # into FAILED before any status can be read: LearnerRun._run, no await in between).
            self.state.phase = "FINISHED" if not self.state.stop_requested else "STOPPING"

    async def _wait_for_replicas(self) -> None:
        st = self.state
        while not await self._live_engines():
            # Paused, it says so (and who paused it): the replicas are not what holds it then.
            st.phase = "PAUSED" if st.paused else "PUSHING_WEIGHTS"
            st.message = st.paused_message if st.paused else "no rollout replica registered yet"
            if st.stop_requested:
                return
            await asyncio.sleep(0.5)
        st.phase, st.message = "PUSHING_WEIGHTS", ""

    async def _hold_while_paused(self) -> None:
        st = self.state
        if not st.paused:
            return
        while st.paused and not st.stop_requested:
            st.phase, st.message = "PAUSED", st.paused_message
            if st.checkpoint_requests and st.step > 0:
                await self._checkpoint(st.step)
                st.phase = "PAUSED"
            await asyncio.sleep(0.2)
        st.message = ""

    def hparams_in_force(self) -> dict[str, float]:
        """The live hyper-parameters as the last step used them (sampling: as prompts are queued
        now), by ``UpdateHyperparamsRequest``'s field names."""
        rollout = self.cfg.actor_rollout_ref.rollout
        actor = self.trainer.actor
        sampling = self.feeder.sampling if self.feeder is not None else None
        values = {
            "kl_coef": float(self.kl_ctrl.value),
            "kl_loss_coef": float(actor.kl_loss_coef),
            "actor_lr": self.trainer.peak_lr(),
            "entropy_coeff": float(actor.entropy_coeff),
            "clip_ratio": float(actor.config.clip_ratio),
            # The tasks carry them as float32: shown at float32's precision (0.9, not 0.899999976).
            "temperature": _f32(sampling.temperature if sampling is not None else rollout.temperature),
            "top_p": _f32(sampling.top_p if sampling is not None else rollout.top_p),
        }
        critic_lr = self.trainer.critic_peak_lr()
        if critic_lr is not None:
            values["critic_lr"] = critic_lr
        return values

    def current_hparams(self) -> dict[str, float]:
        """The values in force now with pending updates applied, by short name."""
        return {**self.hparams_in_force(), **self.state.pending_hparams}

    def _take_hparams(self, step: int) -> dict[str, float]:
        """Applies the pending updates the loop owns (the KL controller, the sampling of prompts
        queued from now on); returns what the trainer applies on every rank before ``step``."""
        hparams, self.state.pending_hparams = self.state.pending_hparams, {}
        self.state.hparams_step = step
        if "kl_coef" in hparams:
            self.kl_ctrl.value = hparams.pop("kl_coef")
        if "top_p" in hparams:
            self.feeder.sampling.top_p = hparams.pop("top_p")
        if "temperature" in hparams:
            value = hparams.pop("temperature")
            self.feeder.sampling.temperature = value
            # Steps already queued keep the temperature they were queued with.
            self._temperature_from.append((max(self.feeder.enqueued, default=step) + 1, value))
        due = [value for first, value in self._temperature_from if first <= step]
        if due:
            hparams["temperature"] = due[-1]
            self._temperature_from = [(f, v) for f, v in self._temperature_from if f > step]
        return hparams

    async def _log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """The sinks (file, console, Prometheus, wandb, mlflow) and the run's metrics stream in
        Redis, which the control plane reads; a Redis outage costs the stream that row only."""
        self.sinks.log(step, metrics)
        if self._redis is None or self.follower:
            return
        try:
            await publish_step_metrics(
                self._redis,
                self.keys,
                step,
                {k: v for k, v in metrics.items() if not k.startswith(JSONL_ONLY_PREFIXES)},
                maxlen=self.cfg.rlmesh.control.history_steps,
            )
        except TRANSIENT_ERRORS as e:
            log.warning("step %d: metrics not published to Redis: %s", step, e)

    async def _step(self) -> None:
        cfg, st = self.cfg, self.state
        step = st.step + 1
        if self.lease.lost:
            raise RuntimeError(f"another learner took over run {self.keys.run_id}: this one stops")
        t_step = time.monotonic()
        st.phase = "WAITING_FOR_ROLLOUTS"
        await retry_redis_with_deadline(
            lambda: self.feeder.ensure(step, st.version, cfg.rlmesh.max_staleness), "enqueue prompts"
        )
        t0 = time.monotonic()
        collected = await self._collect(step)
        self._warn_reward_failures(f"step {step}", collected.rewards)
        self.feeder.taken(collected.groups)
        t_gen = time.monotonic() - t0
        gen_start = time.time() - t_gen  # wall clock, so benchmarks can line phases up across processes
        from rlmesh.learner import build_batch

        st.phase = "TRAINING"
        batch = build_batch(
            collected.trajectories, self.tokenizer.pad_token_id, with_ref=self._ref_from_replicas
        )
        hparams = self._take_hparams(step)
        train = RankCommand("train", batch=batch, kl_ctrl=self.kl_ctrl, hparams=hparams)
        metrics = await asyncio.to_thread(self._collective, train)
        # What this step trained with: a live change shows in the history at the step it reached.
        metrics.update({f"hparams/{k}": v for k, v in self.hparams_in_force().items()})
        st.version += 1
        st.phase = "PUSHING_WEIGHTS"
        t_push = await self.push_weights()
        push_start = time.time() - t_push
        is_last = step >= st.total_steps
        # Before the checkpoint: a step that a checkpoint covers is never redone, so its record
        # must exist by then (one written and then redone after a crash is written again).
        self._record_groups(step, collected)
        if (
            cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or is_last)
        ) or st.checkpoint_requests:
            await self._checkpoint(step)
        expired = self.used_window.popleft() if len(self.used_window) > cfg.rlmesh.max_staleness + 1 else []
        await retry_redis_with_deadline(
            lambda: self.collector.commit(collected, forget_uids=expired), "commit the step"
        )
        self.used_window.append(list(collected.uids))
        self.feeder.forget_before(step)
        response_tokens = sum(len(t.response_ids) for t in collected.trajectories)
        tokens = response_tokens + sum(len(t.prompt_ids) for t in collected.trajectories)
        step_s = time.monotonic() - t_step
        metrics.update(
            {
                "timing_s/gen": t_gen,
                "timing_s/push_weights": t_push,
                **self.push_counts,
                "timing_s/step": step_s,
                "timing_start/gen": gen_start,
                "timing_start/push_weights": push_start,
                "timing_start/step": time.time() - step_s,
                # verl's compute_throughout_metrics: per GPU of the job (1 on a CPU-only run)
                "perf/total_num_tokens": tokens,
                "perf/time_per_step": step_s,
                "perf/throughput": tokens / (max(step_s, 1e-9) * self.job_gpus),
                "training/global_step": step,
                "training/tokens": tokens,
                "training/response_tokens": response_tokens,
                "training/policy_version": st.version,
                "training/epoch": self.feeder.epoch_of.get(step, self.cursor.epoch),
                **{f"training/dropped_{k}": float(v) for k, v in collected.counts.items()},
                **collected.rewards.metrics("reward"),
                **{f"training/{k}": float(v) for k, v in self.recovery.take_counts().items()},
                **_rollout_timings(collected.trajectories),
            }
        )
        metrics.update(timing_per_token_ms(metrics, response_tokens, tokens))
        if self.filter_groups.enable:  # verl's DAPO recipe's and its V1 trainer's names
            metrics.update(
                {
                    "train/num_gen_batches": float(self.gen_batches.num_gen_batches),
                    "training/filter_groups/evicted_samples": float(len(collected.filtered)),
                    "training/filter_groups/kept_groups": float(len(collected.groups)),
                }
            )
        if (
            self.val_set is not None
            and cfg.trainer.test_freq > 0
            and (step % cfg.trainer.test_freq == 0 or is_last)
        ):
            metrics.update(await self._validate(step))
        st.last_metrics = metrics
        st.step = step  # last: GetStatus then shows this step with its own metrics
        await self._log_metrics(step, metrics)

    def _warn_reward_failures(self, where: str, tally: FailureTally) -> None:
        """One warning where rewards failed: the run's first failure in full (its traceback), later
        ones by their first line, so the log says what the run trains on without a line a sample."""
        if not tally.failed:
            return
        first = tally.first if not self._reward_failure_quoted else tally.first.splitlines()[0]
        self._reward_failure_quoted = True
        log.warning("%s: %s; the first: %s", where, self.reward_rule.describe(tally), first)

    def _record_groups(self, step: int, collected: StepBatch) -> None:
        if self.groups_path is None:
            return
        samples = Counter(t.group_uid for t in collected.trajectories)
        row = {
            "step": step,
            "incarnation": self.feeder.incarnation,
            "prompts": [index_of(g) for g in collected.groups],
            "groups": {g: samples[g] for g in collected.groups},
            # ReMax: each group's greedy baseline score (what its advantages were taken against).
            "baselines": {
                t.group_uid: t.baseline_score for t in collected.trajectories if t.HasField("baseline_score")
            },
        }
        if self.filter_groups.enable:  # consumed, not trained: dynamic sampling dropped them
            row["filtered"] = dict(collected.filtered)
            row["filtered_prompts"] = [index_of(g) for g in collected.filtered]
        self.groups_path.parent.mkdir(parents=True, exist_ok=True)
        with self.groups_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    async def _validate(self, step: int, log: bool = False) -> dict[str, float]:
        """Validation metrics; ``log``: to the sinks now (outside a step; a step logs its own)."""
        assert self.val_set is not None
        prev, self.state.phase = self.state.phase, "VALIDATING"
        live = await self._live_engines()
        rollout = self.cfg.actor_rollout_ref.rollout
        result = await run_validation(
            self.val_set.items,
            replicas=[r.grpc_address for r in live],
            score=self.reward.score,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            sampling=val_sampling(rollout.val_kwargs, rollout.response_length),
            batch_size=self.cfg.data.val_batch_size or 64,
            token=self.cfg.rlmesh.token(),
            rule=self.reward_rule,
        )
        self.state.phase = prev
        where = f"validation after step {step}" if step else "validation before training"
        self._warn_reward_failures(where, result.failures)
        self.reward_rule.check(result.failures, where)
        metrics = result.metrics
        # The first trainer.log_val_generations samples (verl's choice) to every sink, before the
        # step's metrics: both under this step.
        self.sinks.log_generations(
            step, select_generations(result.samples, self.cfg.trainer.log_val_generations)
        )
        if log:
            await self._log_metrics(step, metrics)
        failed = f", {result.failures.summary()}" if result.failures.failed else ""
        self.progress(f"validation after step {step}: val/score {metrics['val/score']:.3f}{failed}")
        return metrics

    async def _checkpoint(self, step: int, final: bool = False) -> str:
        self.state.phase = "CHECKPOINTING"
        path = str(self.checkpoint_root / f"global_step_{step}")
        extra = {
            "step": step,
            "version": self.state.version,
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "data_cursor": self.feeder.cursor_after(step),
            "used_uids": sorted(u for uids in self.used_window for u in uids),
            "run_id": self.keys.run_id,
            "sampling": {
                "temperature": float(self.feeder.sampling.temperature),
                "top_p": float(self.feeder.sampling.top_p),
            },
        }
        await asyncio.to_thread(
            self._collective,
            RankCommand("save", path=path, extra=json.loads(json.dumps(extra, default=_jsonable))),
        )
        self.state.last_checkpoint = path
        trainer_cfg = self.cfg.trainer
        limits = [k for k in (trainer_cfg.max_actor_ckpt_to_keep, trainer_cfg.max_critic_ckpt_to_keep) if k]
        # A step's directory holds actor and critic together (a resume needs both): the larger
        # limit decides. Leftovers of saves that died half-way go too.
        from rlmesh.learner.checkpoints.store import prune_checkpoints

        for gone in prune_checkpoints(self.checkpoint_root, max(limits) if limits else None):
            log.info("removed checkpoint %s", gone)
        for _, fut in self.state.checkpoint_requests:
            if not fut.done():
                fut.set_result(path)
        self.state.checkpoint_requests.clear()
        return path


def _f32(value: float) -> float:
    return float(f"{value:.7g}")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint")


def _rollout_timings(trajs: list[trajectory_pb2.Trajectory]) -> dict[str, float]:
    if not trajs:
        return {}
    n = len(trajs)
    return {
        "rollout/generate_s/mean": sum(t.timings.generate_s for t in trajs) / n,
        "rollout/reward_s/mean": sum(t.timings.reward_s for t in trajs) / n,
        "rollout/reference_s/mean": sum(t.timings.reference_s for t in trajs) / n,
        "rollout/queue_wait_s/mean": sum(t.timings.queue_wait_s for t in trajs) / n,
    }
