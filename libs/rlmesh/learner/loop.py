"""The learner's run loop (rank 0 drives, other ranks follow): one PPO step at a time.

    ensure prompt tasks for steps step..step+max_staleness are queued
    collect train_batch_size complete groups (fresh, valid, each trajectory once)
    train_step on every rank (the trainer shards the batch)         -> verl's metrics
    push the new weights to every live replica, bump the version    -> replicas generate with it
    checkpoint every save_freq steps, then commit the step (ack its trajectories)
    validate every test_freq steps

``max_staleness = 0`` is verl's synchronous PPO: step k's prompts are queued only after version
k was pushed, so every trajectory of step k comes from the weights of step k.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import torch
import torch.distributed as dist

from rlmesh.algo import get_kl_controller
from rlmesh.config import RLMeshConfig
from rlmesh.data import PromptCursor, RLHFDataset
from rlmesh.engine.client import EngineClient
from rlmesh.learner.collect import BatchCollector, StepBatch
from rlmesh.learner.feeder import PromptFeeder, index_of
from rlmesh.learner.recovery import LostGroupRecovery
from rlmesh.learner.sinks import MetricsSinks
from rlmesh.learner.validation import val_sampling, validate
from rlmesh.learner.weight_push import WeightPusher, WeightPushError
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.queue import (
    ReplicaRegistry,
    RunKeys,
    TrajectoryCollector,
    connect,
    prompt_queue,
    retry_forever,
    trajectory_queue,
)
from rlmesh.queue.connection import TRANSIENT_ERRORS
from rlmesh.queue.lease import RunLease
from rlmesh.queue.policy import publish_policy
from rlmesh.reward.client import RewardClient
from rlmesh.v1 import common_pb2, trajectory_pb2

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


@dataclass
class LoopState:
    step: int = 0
    total_steps: int = 0
    version: int = 0
    phase: str = "STARTING"
    paused: bool = False
    stop_requested: bool = False
    stop_checkpoint: bool = True
    last_metrics: dict[str, float] = field(default_factory=dict)
    last_checkpoint: str = ""
    live_replicas: int = 0
    message: str = ""
    pending_hparams: dict[str, float] = field(default_factory=dict)
    checkpoint_requests: list[tuple[str, asyncio.Future[str]]] = field(default_factory=list)


def total_training_steps(cfg: RLMeshConfig, dataset_len: int) -> int:
    """verl: trainer.total_training_steps, else total_epochs x batches per epoch."""
    if cfg.trainer.total_training_steps:
        return int(cfg.trainer.total_training_steps)
    return cfg.trainer.total_epochs * max(1, dataset_len // cfg.data.train_batch_size)


# A follower waits for rank 0's next command while rank 0 waits for replicas or batches or holds
# a pause, which can be hours. So that the wait can still be bounded tightly, rank 0 sends a no-op
# every KEEPALIVE_S while it runs no collective; a follower that hears nothing for COMMAND_TIMEOUT
# takes rank 0 for gone. (A dead rank 0 is seen at once, its sockets close; the bound is for a
# rank 0 that hangs or whose host vanished silently.)
KEEPALIVE_S = 30.0
COMMAND_TIMEOUT = timedelta(seconds=10 * KEEPALIVE_S)


class RankZeroLost(RuntimeError):
    """A follower's wait for rank 0's next command failed: rank 0 is gone."""


class Followers:
    """Rank 0 tells the other ranks which collective to run next, then runs its own part.

    Commands go over a gloo group of their own, so that waiting for one is bounded by
    ``COMMAND_TIMEOUT`` (with rank 0's keep-alives), not by the training group's timeout, and
    pickles never touch a GPU. Constructing it is collective: every rank builds one, at the same
    point.

    Rank 0 ends the run with :meth:`finish`, which sends ``("stop", failure)``, but only while the
    followers are known to be waiting for a command: after rank 0's part of a collective failed,
    a follower may still be inside it, and a broadcast it does not expect would hang both. Such a
    follower instead sees rank 0's process exit (its sockets close) and exits too.
    """

    def __init__(self, timeout: timedelta = COMMAND_TIMEOUT, keepalive_s: float = KEEPALIVE_S) -> None:
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.world > 1 else None
        # Rank 0: a command was announced and rank 0's own part of it has not completed.
        self.in_collective = False
        self.finished = False
        self._sending = threading.Lock()  # one broadcast at a time: a command or a keep-alive
        self._stop_keepalive = threading.Event()
        if self.world > 1 and dist.get_rank() == 0:
            threading.Thread(
                target=self._keep_alive, args=(keepalive_s,), name="followers-keepalive", daemon=True
            ).start()

    def _keep_alive(self, every_s: float) -> None:
        while not self._stop_keepalive.wait(every_s):
            with self._sending:
                if self.in_collective or self.finished:
                    continue  # the followers are inside a collective, not waiting for a command
                try:
                    dist.broadcast_object_list([("noop",)], src=0, group=self.group)
                except RuntimeError as e:
                    log.error("keep-alive to the other ranks failed: %s", e)
                    return

    def announce(self, command: tuple[Any, ...]) -> None:
        """Rank 0: send ``command``; call :meth:`done` once rank 0's own part of it completed."""
        if self.world > 1:
            with self._sending:
                self.in_collective = True
                dist.broadcast_object_list([command], src=0, group=self.group)

    def done(self) -> None:
        with self._sending:
            self.in_collective = False

    def finish(self, failure: str = "") -> None:
        """Rank 0: tell the followers the run is over (``failure``: why it failed, if it did).
        Idempotent; never raises (a follower that already died cannot be told)."""
        self._stop_keepalive.set()
        with self._sending:
            if self.world == 1 or self.finished:
                return
            self.finished = True
            if self.in_collective:
                log.error("rank 0 stopped inside a collective: the other ranks stop when this process exits")
                return
            try:
                dist.broadcast_object_list([("stop", failure)], src=0, group=self.group)
            except RuntimeError as e:
                log.error("could not tell the other ranks to stop: %s", e)

    def receive(self) -> tuple[Any, ...]:
        """Ranks > 0: the next command; raises ``RankZeroLost`` when rank 0 is gone."""
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as e:
            raise RankZeroLost(f"waiting for rank 0's next command failed: {e}") from e
        return box[0]


def follow(trainer: Any, followers: Followers) -> str:
    """Ranks > 0: run the collectives rank 0 announces, until it says stop.

    Returns:
        rank 0's failure, or "" when its run ended normally.

    Raises:
        RankZeroLost: rank 0 died (or its host vanished) without saying stop.
    """
    while True:
        command = followers.receive()
        kind = command[0]
        if kind == "stop":
            return str(command[1]) if len(command) > 1 else ""
        if kind == "noop":
            continue
        if kind == "train":
            if command[3]:
                trainer.update_hyperparams(**command[3])
            trainer.train_step(command[1], command[2])
        elif kind == "push":
            for _ in trainer.named_weights_for_push(command[1]):
                pass
        elif kind == "save":
            trainer.save_checkpoint(command[1], command[2])
        elif kind == "load":
            trainer.load_checkpoint(command[1])
        elif kind == "export":
            trainer.export_hf(command[1], None)
        else:
            raise ValueError(f"unknown command from rank 0: {kind!r}")


class _StoppedWhileWaiting(Exception):
    """A stop was requested while the loop waited for a batch that did not come: a clean stop."""


class TrainingLoop:
    def __init__(
        self,
        cfg: RLMeshConfig,
        make_trainer: Callable[[RLMeshConfig, int], Any],
        *,
        registry: Any = None,
        progress: Callable[[str], None] | None = None,
        follower: bool = False,
    ) -> None:
        self.cfg = cfg
        self.state = LoopState()
        self.keys = RunKeys(cfg.rlmesh.run_id or "default")
        self.tokenizer = load_tokenizer(cfg.tokenizer_path())
        self.train_set = RLHFDataset.from_config(cfg.data, self.tokenizer, split="train")
        self.val_set = (
            RLHFDataset.from_config(cfg.data, self.tokenizer, split="val") if cfg.data.val_files else None
        )
        self.sampler = PromptCursor.from_config(cfg.data, self.train_set)
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
        )
        # Uids of the last max_staleness + 2 committed steps: the used set in Redis holds these
        # only. A copy of an older step's sample cannot be taken anyway (its group is no longer
        # outstanding, or of an older incarnation), so the set does not grow with the run.
        self.used_window: deque[list[str]] = deque()
        # What each committed step trained on, one line per step (a resumed run appends the steps
        # it redoes again: the last line of a step counts). The chaos tests audit runs with it.
        self.groups_path = None if follower else out_dir / "trained_groups.jsonl"
        self._redis: aioredis.Redis | None = None

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
            self.sampler,
            batch_size=cfg.data.train_batch_size,
            n=rollout.n,
            incarnation=self.incarnation,
            sampling=sampling,
        )
        from rlmesh.learner import validate_trajectory

        self.collector = BatchCollector(
            TrajectoryCollector(trajs, self.keys.used_uids),
            n=rollout.n,
            incarnation=self.incarnation,
            max_staleness=cfg.rlmesh.max_staleness,
            validate=functools.partial(validate_trajectory, needs_ref=cfg.uses_reference()),
            wanted=lambda gid: gid in self.feeder.outstanding,
        )
        self.recovery = LostGroupRecovery(self.feeder, self.collector)
        self.replicas = ReplicaRegistry(redis, self.keys, ttl_s=q.heartbeat_ttl_s)
        ws = cfg.rlmesh.weight_sync
        backend = ws.backend if ws.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        self.pusher = WeightPusher(
            [],
            backend=backend,
            master_address=ws.master_address,
            timeout_s=ws.timeout_s,
            control_timeout_s=ws.control_timeout_s,
            bucket_bytes=ws.bucket_size_mb << 20,
            load_format=None if ws.load_format == "per_tensor" else ws.load_format,
            verify_tensors=ws.verify_tensors,
        )
        self.reward = RewardClient.from_config(cfg, redis=redis)

    def _resume(self) -> None:
        from rlmesh.learner import latest_checkpoint

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
        self._collective("load", path)
        extra = self._loaded_extra
        self.state.step = int(extra["step"])
        self.state.version = int(extra["version"])
        self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        self.sampler.load_state_dict(extra["data_cursor"])
        self.used_window = deque([list(extra.get("used_uids", []))])
        self.state.last_checkpoint = path

    # ----- collectives: rank 0 announces, then runs its own part -----
    def _collective(self, kind: str, *args: Any) -> Any:
        if kind == "train":
            batch, hparams = args
            self.followers.announce(("train", batch, self.kl_ctrl, hparams))
            if hparams:
                self.trainer.update_hyperparams(**hparams)
            result = self.trainer.train_step(batch, self.kl_ctrl)
        elif kind == "save":
            path, extra = args
            self.followers.announce(("save", path, extra))
            result = self.trainer.save_checkpoint(path, extra)
        elif kind == "export":
            (path,) = args
            self.followers.announce(("export", path))
            result = self.trainer.export_hf(path, None)
        elif kind == "load":
            (path,) = args
            self.followers.announce(("load", path))
            result = self._loaded_extra = self.trainer.load_checkpoint(path)
        else:
            raise ValueError(kind)
        self.followers.done()  # not reached when rank 0's part raised: see Followers.finish
        return result

    def _weight_buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket_bytes = self.cfg.rlmesh.weight_sync.bucket_size_mb << 20
        self.followers.announce(("push", bucket_bytes))
        # No copy: the pusher is done with each bucket (copied into its flat buffer, or sent)
        # before it asks for the next, and no optimizer step runs during a push.
        yield from self.trainer.named_weights_for_push(bucket_bytes, copy=False)
        self.followers.done()  # an abandoned push leaves the followers' state unknown

    # ----- weight sync -----
    async def _live_engines(self) -> list[trajectory_pb2.ReplicaRegistration]:
        """Live replicas from the registry; the pusher targets exactly their engines."""
        live = [
            r for r in await retry_forever(self.replicas.live, "read the replicas") if r.state != "draining"
        ]
        self.state.live_replicas = len(live)
        timeout = self.cfg.rlmesh.weight_sync.timeout_s
        known = {link.client.url: link.client for link in self.pusher.links}
        clients = [
            known.get(r.engine_url.rstrip("/"))
            or EngineClient(r.engine_url, name=r.replica_id, timeout_s=timeout)
            for r in live
        ]
        # An SGLang engine's TP workers each join its weight group (an older registry entry: 0).
        ranks = [max(1, r.weight_sync_ranks) for r in live]
        for unused in self.pusher.set_engines(clients, ranks):
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
        except WeightPushError as e:
            # No replica took them: each is dead, restarting or cut off. Not the run's end: the
            # live ones get them while the next batch is awaited (only_behind), a dead one leaves
            # the registry, and a restarted one joins behind and is brought up the same way.
            failed = e.failed
        for name, why in failed.items():
            log.error("replica %s dropped from the push of v%d: %s", name, version, why)
        await retry_forever(
            lambda: publish_policy(self._redis, self.keys, version, path), "publish the policy"
        )
        return time.monotonic() - t0

    def _export_snapshot(self, version: int) -> str:
        root = Path(self.cfg.rlmesh.weight_sync.disk_dir or self.checkpoint_root / "weights")
        path = root / f"v{version}"
        self._collective("export", str(path))  # collective under ZeRO-3: every rank takes part
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
            nonlocal last_sync
            self.state.message = f"step {step}: {have}/{want} prompt groups collected"

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
            self.state.phase = "PUSHING_WEIGHTS"
            self.progress(
                f"run {self.keys.run_id}: {self.state.total_steps} steps, waiting for rollout replicas"
            )
            await self._wait_for_replicas()
            if not self.state.stop_requested:
                await self.push_weights()
                if cfg.trainer.val_before_train and self.val_set is not None and self.state.step == 0:
                    await self._validate(0)
            try:
                while self.state.step < self.state.total_steps and not self.state.stop_requested:
                    await self._hold_while_paused()
                    await self._step()
            except _StoppedWhileWaiting:
                self.progress(f"stopped while waiting for the batch of step {self.state.step + 1}")
            # Not after a failure: the trainer may be half-way through a step (and under several
            # ranks the others may still be inside a collective); the last checkpoint stands.
            if self.state.stop_requested and self.state.stop_checkpoint and self.state.step > 0:
                await self._checkpoint(self.state.step, final=True)
        except BaseException as e:
            failure = f"{type(e).__name__}: {e}"
            raise
        finally:
            # Every exit, failures included: the other ranks wait for rank 0's next command.
            self.followers.finish(failure)
            self.state.phase = "FINISHED" if not self.state.stop_requested else "STOPPING"
            self.sinks.close()
            if hasattr(self, "reward"):  # absent when _connect failed part-way
                await self.reward.close()
            if hasattr(self, "pusher"):
                await self.pusher.close()
            if hasattr(self, "_lease_task"):
                self._lease_task.cancel()
                with contextlib.suppress(Exception):
                    await self.lease.release()
            if self._redis is not None:
                await self._redis.aclose()

    async def _wait_for_replicas(self) -> None:
        while not await self._live_engines():
            self.state.message = "no rollout replica registered yet"
            if self.state.stop_requested:
                return
            await asyncio.sleep(0.5)

    async def _hold_while_paused(self) -> None:
        while self.state.paused and not self.state.stop_requested:
            self.state.phase = "PAUSED"
            if self.state.checkpoint_requests and self.state.step > 0:
                await self._checkpoint(self.state.step)
                self.state.phase = "PAUSED"
            await asyncio.sleep(0.2)

    def current_hparams(self) -> dict[str, float]:
        """The values in force now (pending updates included), by short name."""
        cfg = self.cfg
        values = {
            "kl_coef": float(self.kl_ctrl.value),
            "lr": float(getattr(self.trainer, "current_lr", lambda: cfg.actor_rollout_ref.actor.optim.lr)()),
            "entropy_coeff": float(
                getattr(self.trainer, "entropy_coeff", cfg.actor_rollout_ref.actor.entropy_coeff)
            ),
            "temperature": float(
                self.feeder.sampling.temperature
                if hasattr(self, "feeder")
                else cfg.actor_rollout_ref.rollout.temperature
            ),
        }
        values.update(self.state.pending_hparams)
        return values

    async def _step(self) -> None:
        cfg, st = self.cfg, self.state
        step = st.step + 1
        if self.lease.lost:
            raise RuntimeError(f"another learner took over run {self.keys.run_id}: this one stops")
        t_step = time.monotonic()
        st.phase = "WAITING_FOR_ROLLOUTS"
        await retry_forever(
            lambda: self.feeder.ensure(step, st.version, cfg.rlmesh.max_staleness), "enqueue prompts"
        )
        t0 = time.monotonic()
        collected = await self._collect(step)
        self.feeder.taken(collected.groups)
        t_gen = time.monotonic() - t0
        gen_start = time.time() - t_gen  # wall clock, so benchmarks can line phases up across processes
        from rlmesh.learner import build_batch

        st.phase = "TRAINING"
        batch = build_batch(
            collected.trajectories, self.tokenizer.pad_token_id, with_ref=self.cfg.uses_reference()
        )
        hparams, st.pending_hparams = st.pending_hparams, {}
        if "kl_coef" in hparams:
            self.kl_ctrl.value = hparams.pop("kl_coef")
        if "temperature" in hparams:  # sampling of the prompts queued from now on
            self.feeder.sampling.temperature = hparams.pop("temperature")
        metrics = await asyncio.to_thread(self._collective, "train", batch, hparams)
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
        await retry_forever(lambda: self.collector.commit(collected, forget_uids=expired), "commit the step")
        self.used_window.append(list(collected.uids))
        self.feeder.forget_before(step)
        response_tokens = sum(len(t.response_ids) for t in collected.trajectories)
        tokens = response_tokens + sum(len(t.prompt_ids) for t in collected.trajectories)
        step_s = time.monotonic() - t_step
        metrics.update(
            {
                "timing_s/gen": t_gen,
                "timing_s/push_weights": t_push,
                "timing_s/step": step_s,
                "timing_start/gen": gen_start,
                "timing_start/push_weights": push_start,
                "timing_start/step": time.time() - step_s,
                "perf/throughput": tokens / max(step_s, 1e-9),
                "training/global_step": step,
                "training/tokens": tokens,
                "training/response_tokens": response_tokens,
                "training/policy_version": st.version,
                "training/epoch": self.sampler.epoch,
                **{f"training/dropped_{k}": float(v) for k, v in collected.counts.items()},
                **{f"training/{k}": float(v) for k, v in self.recovery.take_counts().items()},
                **_rollout_timings(collected.trajectories),
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
        self.sinks.log(step, metrics)

    def _record_groups(self, step: int, collected: StepBatch) -> None:
        if self.groups_path is None:
            return
        samples = Counter(t.group_uid for t in collected.trajectories)
        row = {
            "step": step,
            "incarnation": self.feeder.incarnation,
            "prompts": [index_of(g) for g in collected.groups],
            "groups": {g: samples[g] for g in collected.groups},
        }
        self.groups_path.parent.mkdir(parents=True, exist_ok=True)
        with self.groups_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    async def _validate(self, step: int) -> dict[str, float]:
        assert self.val_set is not None
        prev, self.state.phase = self.state.phase, "VALIDATING"
        live = await self._live_engines()
        rollout = self.cfg.actor_rollout_ref.rollout
        metrics = await validate(
            self.val_set.items,
            replicas=[r.grpc_address for r in live],
            score=self.reward.score,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            sampling=val_sampling(rollout.val_kwargs, rollout.response_length),
            batch_size=self.cfg.data.val_batch_size or 64,
            token=self.cfg.rlmesh.auth_token,
        )
        self.state.phase = prev
        if step == 0:
            self.sinks.log(0, metrics)
        self.progress(f"validation after step {step}: val/score {metrics['val/score']:.3f}")
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
        }
        await asyncio.to_thread(
            self._collective, "save", path, json.loads(json.dumps(extra, default=_jsonable))
        )
        self.state.last_checkpoint = path
        trainer_cfg = self.cfg.trainer
        limits = [k for k in (trainer_cfg.max_actor_ckpt_to_keep, trainer_cfg.max_critic_ckpt_to_keep) if k]
        # A step's directory holds actor and critic together (a resume needs both): the larger
        # limit decides. Leftovers of saves that died half-way go too.
        from rlmesh.learner.checkpoint import prune_checkpoints

        for gone in prune_checkpoints(self.checkpoint_root, max(limits) if limits else None):
            log.info("removed checkpoint %s", gone)
        for _, fut in self.state.checkpoint_requests:
            if not fut.done():
                fut.set_result(path)
        self.state.checkpoint_requests.clear()
        return path


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


def learner_env_defaults() -> None:
    """Single-process DeepSpeed needs the env a launcher would set (deepspeed-cpu notes)."""
    from rlmesh.runtime.net import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
