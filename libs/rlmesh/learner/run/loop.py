"""The learner's run loop (rank 0 drives, other ranks follow): one PPO step at a time.

docs/design.md#one-ppo-step-as-data"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlmesh.algo import get_kl_controller
from rlmesh.config import RLMeshConfig
from rlmesh.data import PromptCursor, RLHFDataset
from rlmesh.data.cursor import total_training_steps
from rlmesh.learner.checkpoints.store import latest_checkpoint, prune_checkpoints, replace_dir
from rlmesh.learner.ppo.batch import BatchBuffers, BatchBuilder
from rlmesh.learner.ppo.model_loading import first_policy_version
from rlmesh.learner.run.collect import StepBatch
from rlmesh.learner.run.commands import Followers, RankCommand
from rlmesh.learner.run.dynamic_sampling import GenBatches, draw_in_place
from rlmesh.learner.run.feeder import PromptFeeder, index_of, step_of
from rlmesh.learner.run.loop_state import START_PAUSED, LoopState, hold_while_paused, wait_for_replicas
from rlmesh.learner.run.sinks import JSONL_ONLY_PREFIXES, MetricsSinks
from rlmesh.learner.run.step_metrics import StepClock, job_gpus, step_metrics
from rlmesh.learner.run.trainer_thread import RankZero, TrainerThread
from rlmesh.learner.run.validation import run_validation, select_generations, val_sampling
from rlmesh.learner.run.wiring import RunWiring, StoppedBeforeLease, mark_run_ended, sampling_params, wire_run
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.queue import RunKeys, retry_redis_with_deadline
from rlmesh.queue.connection import TRANSIENT_ERRORS
from rlmesh.queue.policy import read_policy
from rlmesh.queue.retention import expire_run_keys
from rlmesh.queue.run_info import publish_step_metrics
from rlmesh.queue.signing import expose_untrusted
from rlmesh.reward.failures import FailureTally, RewardErrorRule
from rlmesh.v1 import trajectory_pb2

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from rlmesh.learner.trainer import PPOTrainer

log = logging.getLogger("rlmesh.learner")
# How long the learner waits for an unreachable Redis before the run fails.
REDIS_DEADLINE_S = 300.0


class _StoppedWhileWaiting(Exception):
    """A stop was requested while the loop waited for a batch that did not come: a clean stop."""


class TrainingLoop:
    """Rank 0's run: ``run`` wires it (``wire_run``), then steps until the last; a follower rank
    builds one only for its trainer and ``followers``. Every trainer call goes through
    ``trainer_thread`` (docs/design.md#one-steps-concurrency)."""

    def __init__(
        self,
        cfg: RLMeshConfig,
        make_trainer: Callable[[RLMeshConfig, int], PPOTrainer],
        *,
        registry: CollectorRegistry | None = None,
        progress: Callable[[str], None] | None = None,
        follower: bool = False,
        trainer_thread: TrainerThread | None = None,
    ) -> None:
        self.cfg = cfg
        self.follower = follower
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
        self.trainer_thread = trainer_thread or TrainerThread()
        self.rank_zero = RankZero(self.trainer, self.followers, self.trainer_thread)
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
        # What the prompt tasks carry; the feeder queues with it and live updates change it.
        self.sampling = sampling_params(cfg)
        # Temperatures set live, each with the first step whose prompts were queued with it: the
        # learner scores a step's samples at the temperature that generated them.
        self._temperature_from: list[tuple[int, float]] = []
        # Whether the trajectories must carry the reference log-probs (the service's, through the
        # replicas). A colocated reference recomputes them in the trainer: whatever a trajectory
        # carries (a replica of an older config) is ignored.
        self._ref_from_replicas = cfg.uses_reference() and not cfg.rlmesh.reference.colocated
        self._batch_buffers = BatchBuffers()  # a step's batch is written into the last one's arrays
        self.job_gpus = job_gpus(cfg, torch.cuda.is_available())
        # DAPO's dynamic sampling: the prompts each step draws (algorithm.filter_groups).
        self.filter_groups = cfg.algorithm.filter_groups
        self.gen_batches = GenBatches(cfg.data.train_batch_size, self.filter_groups.max_num_gen_batches)
        self.reward_rule = RewardErrorRule.from_config(cfg)
        self._reward_failure_quoted = False  # the run's first failed reward is logged in full, once
        # Policy versions pushed past the checkpoint a learner resumed from, by the one that died
        # (``_roll_forward``); kept in checkpoints while samples of them could still arrive.
        self.refused_versions: list[tuple[int, int]] = []
        self.redone_steps = 0  # steps a learner before this one trained past its checkpoint
        self.checkpoint_s = 0.0  # the step's checkpoint, as long as the step waited for it

    # ----- the run -----
    async def run(self) -> None:
        cfg, st = self.cfg, self.state
        failure = ""
        w: RunWiring | None = None
        self.rank_zero.start_keepalive()  # first: the followers wait for a command from now on
        try:
            try:
                w = await wire_run(
                    cfg,
                    self.keys,
                    train_set=self.train_set,
                    cursor=self.cursor,
                    sampling=self.sampling,
                    vocab_size=getattr(self.trainer, "vocab_size", None),
                    ref_from_replicas=self._ref_from_replicas,
                    reward_rule=self.reward_rule,
                    rank_zero=self.rank_zero,
                    state=st,
                    checkpoint_root=self.checkpoint_root,
                    progress=self.progress,
                )
            except StoppedBeforeLease as e:  # a standby that never took over: nothing to end
                self.progress(str(e))
                return
            await self._resume(w)
            if st.step == 0:  # an engine that has not had the push below takes no work
                st.version = first_policy_version(cfg.actor_rollout_ref.model.lora_adapter_path)
            await self._roll_forward(w)
            st.phase = "PUSHING_WEIGHTS"
            self.progress(f"run {self.keys.run_id}: {st.total_steps} steps, waiting for rollout replicas")
            await wait_for_replicas(st, w.push.live_engines)
            if not st.stop_requested:
                await w.push.push()
                if cfg.trainer.val_only:
                    # verl validates only when val_before_train is also set; here val_only is enough.
                    await self._validate(w, st.step, log=True)
                    self.progress(f"trainer.val_only: validated the policy of step {st.step}, no training")
                    return
                if cfg.trainer.val_before_train and self.val_set is not None and st.step == 0:
                    await self._validate(w, 0, log=True)
            try:
                while st.step < st.total_steps and not st.stop_requested:
                    await hold_while_paused(st, functools.partial(self._checkpoint, w))
                    if st.stop_requested:  # stopped while paused: no step after the stop
                        break
                    await self._step(w)
            except _StoppedWhileWaiting:
                self.progress(f"stopped while waiting for the batch of step {st.step + 1}")
            # Not after a failure: the trainer may be half-way through a step (and under several
            # ranks the others may still be inside a collective); the last checkpoint stands.
            if st.stop_requested and st.stop_checkpoint and st.step > 0:
                await self._checkpoint(w, st.step, final=True)
            # The last checkpoint whole before the run ends (its writer dies with the process).
            await self.rank_zero.run(RankCommand("wait_for_checkpoint"))
            self._prune_checkpoints()
            if st.step >= st.total_steps and cfg.rlmesh.learner.export_dir:
                await self._export_actor(cfg.rlmesh.learner.export_dir)
            if st.step >= st.total_steps:
                ttl_s = cfg.rlmesh.queue.finished_run_ttl_s
                expiring = await expire_run_keys(w.redis, self.keys, ttl_s)
                if expiring:
                    self.progress(
                        f"run {self.keys.run_id} finished: its {expiring} Redis keys expire in {ttl_s} s"
                    )
        except BaseException as e:
            failure = f"{type(e).__name__}: {e}"
            raise
        finally:
            # Every exit, failures included: the other ranks wait for rank 0's next command.
            await self.rank_zero.finish(failure)
            self.sinks.close()
            if w is not None:  # None when wiring failed: it closed what it had made itself
                if not failure and not st.replaceable:  # before the lease goes: no standby takes over
                    finished = st.step >= st.total_steps
                    await mark_run_ended(
                        w.redis,
                        self.keys,
                        "finished" if finished else f"stopped at step {st.step}",
                        ttl_s=cfg.rlmesh.queue.finished_run_ttl_s if finished else 0,
                    )
                await w.aclose()
            # Last, once nothing here uses the replicas, the reward or Redis any more: `rlmesh
            # train` stops them when it reads this, while this process exits (a failure turns it
            # into FAILED before any status can be read: LearnerRun._run, no await in between).
            st.phase = "FINISHED" if not st.stop_requested else "STOPPING"

    async def _resume(self, w: RunWiring) -> None:
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
        extra = await self.rank_zero.run(RankCommand("load", path=path))
        self.state.step = int(extra["step"])
        self.state.version = int(extra["version"])
        self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        w.feeder.load_state_dict(extra)
        self.used_window = deque([list(extra.get("used_uids", []))])
        sampling = extra.get("sampling") or {}  # set live before the checkpoint (older ones: none)
        for name in ("temperature", "top_p"):
            if name in sampling:
                setattr(self.sampling, name, float(sampling[name]))
        self.refused_versions = [(int(lo), int(hi)) for lo, hi in extra.get("refused_versions", [])]
        self.state.last_checkpoint = path

    async def _roll_forward(self, w: RunWiring) -> None:
        """A policy version names one set of weights for the whole run. A learner that died after
        its checkpoint had pushed versions past it, which this one, resumed from the checkpoint, no
        longer has: its weights are pushed as the next version unused, and samples of those
        versions (a replica that missed the push) are refused, like stale ones."""
        st = self.state
        policy = await retry_redis_with_deadline(lambda: read_policy(w.redis, self.keys), "read the policy")
        if policy.version > st.version:
            self.redone_steps = policy.version - st.version  # a push a step
            self.refused_versions.append((st.version + 1, policy.version))
            self.progress(
                f"a learner before this one trained {self.redone_steps} step(s) past step {st.step} (policy "
                f"v{policy.version}); they are done again, with this policy as v{policy.version + 1}"
            )
            st.version = policy.version + 1
        w.collector.refused_versions = self.refused_versions

    # ----- one step -----
    async def _step(self, w: RunWiring) -> None:
        """verl's fit-loop body: enqueue, collect, build the batch, train, push, record,
        checkpoint, commit, metrics, validate."""
        cfg, st = self.cfg, self.state
        step = st.step + 1
        if w.lease.lost:
            raise RuntimeError(f"another learner took over run {self.keys.run_id}: this one stops")
        t_step = time.monotonic()
        st.phase = "WAITING_FOR_ROLLOUTS"
        await retry_redis_with_deadline(
            lambda: w.feeder.ensure(step, st.version, cfg.rlmesh.max_staleness), "enqueue prompts"
        )

        in_flight = len(w.feeder.outstanding)

        t_gen = time.monotonic()
        collected = await self._collect(w, step)
        self._warn_reward_failures(f"step {step}", collected.rewards)
        w.feeder.taken(collected.groups)
        gen_s = time.monotonic() - t_gen
        gen_start = time.time() - gen_s  # wall clock, so benchmarks can line phases up across processes

        st.phase = "TRAINING"
        hparams = self._take_hparams(step, w.feeder)
        batch = collected.batch
        assert batch is not None  # _collect passes new_batch
        trained = await self.rank_zero.run(
            RankCommand("train", batch=batch, kl_ctrl=self.kl_ctrl, hparams=hparams)
        )
        # What this step trained with: a live change shows in the history at the step it reached.
        trained.update({f"hparams/{k}": v for k, v in self.hparams_in_force().items()})
        st.version += 1

        st.phase = "PUSHING_WEIGHTS"
        push_s = await w.push.push()
        push_start = time.time() - push_s

        is_last = step >= st.total_steps
        # Before the checkpoint: a step that a checkpoint covers is never redone, so its record
        # must exist by then (one written and then redone after a crash is written again).
        self._record_groups(step, collected, w.incarnation)
        self.checkpoint_s = 0.0
        if (
            cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or is_last)
        ) or st.checkpoint_requests:
            await self._checkpoint(w, step)
        await self._commit(w, step, collected)

        step_s = time.monotonic() - t_step
        metrics = step_metrics(
            trained,
            step=step,
            version=st.version,
            epoch=w.feeder.epoch_of.get(step, self.cursor.epoch),
            collected=collected,
            clock=StepClock(gen_s, gen_start, push_s, push_start, step_s, time.time() - step_s),
            push_counts=w.push.counts,
            recovered=w.recovery.take_counts(),
            job_gpus=self.job_gpus,
            num_gen_batches=self.gen_batches.num_gen_batches if self.filter_groups.enable else None,
        )
        # The first step of a learner that replaced one: how many steps the one before trained
        # past the checkpoint, lost with it and done again (the failover's cost).
        metrics["training/redone_steps"], self.redone_steps = float(self.redone_steps), 0
        # The long tail carried over: groups in flight as the step began, and those of its batch
        # enqueued for an earlier step (max_staleness, over_provision).
        metrics["training/groups_in_flight"] = float(in_flight)
        metrics["training/carried_groups"] = float(sum(0 <= step_of(g) < step for g in collected.groups))
        # What the checkpoint cost the step (with async_checkpoint: its snapshot), and how long the
        # last one written in the background took to write.
        metrics["timing_s/save_checkpoint"] = self.checkpoint_s
        metrics["checkpoint/write_s"] = self.trainer.checkpoint_writer.written_s
        if (
            self.val_set is not None
            and cfg.trainer.test_freq > 0
            and (step % cfg.trainer.test_freq == 0 or is_last)
        ):
            metrics.update(await self._validate(w, step))
        st.last_metrics = metrics
        st.step = step  # last: GetStatus then shows this step with its own metrics
        await self._log_metrics(w, step, metrics)

    async def _collect(self, w: RunWiring, step: int) -> StepBatch:
        cfg = self.cfg

        async def requeue(traj: trajectory_pb2.Trajectory) -> None:
            known = w.feeder.outstanding.get(traj.group_uid)
            if known is None:
                # Already enqueued again (its samples came in over several reads) or replaced:
                # another copy would only duplicate the prompt.
                return
            await w.feeder.requeue(traj.group_uid, known[1], step, self.state.version)

        last_sync = time.monotonic()

        def progress(have: int, want: int) -> None:
            self.state.message = f"step {step}: {have}/{want} prompt groups collected"

        self.gen_batches.start_step()

        async def refill(dropped: list[str]) -> None:
            # DAPO: a new prompt of the data in place of each group whose samples all scored alike.
            await draw_in_place(w.feeder, self.gen_batches, dropped, step, self.state.version)

        rollout = cfg.actor_rollout_ref.rollout

        def new_batch() -> BatchBuilder:
            return BatchBuilder(
                self.tokenizer.pad_token_id,
                rows=cfg.data.train_batch_size * rollout.n,
                max_prompt_length=cfg.data.max_prompt_length,
                max_response_length=rollout.response_length,
                with_ref=self._ref_from_replicas,
                buffers=self._batch_buffers,
            )

        unreachable_since: float | None = None
        while True:
            try:
                try:
                    return await w.collector.collect(
                        cfg.data.train_batch_size,
                        self.state.version,
                        timeout_s=5.0,
                        requeue=requeue,
                        on_progress=progress,
                        refill=refill,
                        step=step,
                        new_batch=new_batch,
                    )
                except TimeoutError:  # the builtin one: nothing complete yet
                    pass
                # A replica may have joined behind our version; bring it up.
                if time.monotonic() - last_sync > 5:
                    await w.push.push(only_behind=True)
                    last_sync = time.monotonic()
                if self.state.stop_requested:
                    raise _StoppedWhileWaiting from None
                await w.recovery.check(self.state.version)
                unreachable_since = None
            except TRANSIENT_ERRORS as e:
                # Redis away (restarting from its append-only file, or cut off): wait for it. What
                # this round had claimed stays pending and is taken back as orphaned.
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > REDIS_DEADLINE_S:
                    raise
                log.warning("step %d: Redis unavailable while collecting (%s); retrying", step, e)
                await asyncio.sleep(1.0)

    async def _commit(self, w: RunWiring, step: int, collected: StepBatch) -> None:
        """Acks the step's trajectories and marks their uids used (one transaction); forgets the
        uids of the step that falls out of the staleness window."""
        expired = (
            self.used_window.popleft() if len(self.used_window) > self.cfg.rlmesh.max_staleness + 1 else []
        )
        await retry_redis_with_deadline(
            lambda: w.collector.commit(collected, forget_uids=expired), "commit the step"
        )
        self.used_window.append(list(collected.uids))
        w.feeder.forget_before(step)

    # ----- live hyper-parameters -----
    def hparams_in_force(self) -> dict[str, float]:
        """The live hyper-parameters as the last step used them (sampling: as prompts are queued
        now), by ``UpdateHyperparamsRequest``'s field names."""
        actor = self.trainer.actor
        values = {
            "kl_coef": float(self.kl_ctrl.value),
            "kl_loss_coef": float(actor.kl_loss_coef),
            "actor_lr": self.trainer.actor_peak_lr(),
            "entropy_coeff": float(actor.entropy_coeff),
            "clip_ratio": float(actor.config.clip_ratio),
            # The tasks carry them as float32: shown at float32's precision (0.9, not 0.899999976).
            "temperature": _f32(self.sampling.temperature),
            "top_p": _f32(self.sampling.top_p),
        }
        critic_lr = self.trainer.critic_peak_lr()
        if critic_lr is not None:
            values["critic_lr"] = critic_lr
        return values

    def current_hparams(self) -> dict[str, float]:
        """The values in force now with pending updates applied, by short name."""
        return {**self.hparams_in_force(), **self.state.pending_hparams}

    def _take_hparams(self, step: int, feeder: PromptFeeder) -> dict[str, float]:
        """Applies the pending updates the loop owns (the KL controller, the sampling of prompts
        queued from now on); returns what the trainer applies on every rank before ``step``."""
        hparams, self.state.pending_hparams = self.state.pending_hparams, {}
        self.state.hparams_step = step
        if "kl_coef" in hparams:
            self.kl_ctrl.value = hparams.pop("kl_coef")
        if "top_p" in hparams:
            self.sampling.top_p = hparams.pop("top_p")
        if "temperature" in hparams:
            value = hparams.pop("temperature")
            self.sampling.temperature = value
            # Steps already queued keep the temperature they were queued with.
            self._temperature_from.append((max(feeder.enqueued, default=step) + 1, value))
        due = [value for first, value in self._temperature_from if first <= step]
        if due:
            hparams["temperature"] = due[-1]
            self._temperature_from = [(f, v) for f, v in self._temperature_from if f > step]
        return hparams

    # ----- records: metrics, trained groups, checkpoints, the exported actor -----
    async def _log_metrics(self, w: RunWiring, step: int, metrics: dict[str, float]) -> None:
        """The sinks (file, console, Prometheus, wandb, mlflow) and the run's metrics stream in
        Redis, which the control plane reads; a Redis outage costs the stream that row only."""
        self.sinks.log(step, metrics)
        try:
            await publish_step_metrics(
                w.redis,
                self.keys,
                step,
                {k: v for k, v in metrics.items() if not k.startswith(JSONL_ONLY_PREFIXES)},
                maxlen=self.cfg.rlmesh.control.history_steps,
            )
        except TRANSIENT_ERRORS as e:
            log.warning("step %d: metrics not published to Redis: %s", step, e)

    def _warn_reward_failures(self, where: str, tally: FailureTally) -> None:
        """One warning where rewards failed: the run's first failure in full (its traceback), later
        ones by their first line, so the log says what the run trains on without a line a sample."""
        if not tally.failed:
            return
        first = tally.first if not self._reward_failure_quoted else tally.first.splitlines()[0]
        self._reward_failure_quoted = True
        log.warning("%s: %s; the first: %s", where, self.reward_rule.describe(tally), first)

    def _record_groups(self, step: int, collected: StepBatch, incarnation: int) -> None:
        if self.groups_path is None:
            return
        samples = Counter(t.group_uid for t in collected.trajectories)
        row = {
            "step": step,
            "incarnation": incarnation,
            "prompts": [index_of(g) for g in collected.groups],
            "groups": {g: samples[g] for g in collected.groups},
            # ReMax: each group's greedy baseline score (what its advantages were taken against).
            "baselines": {
                t.group_uid: t.baseline_score for t in collected.trajectories if t.HasField("baseline_score")
            },
        }
        # Per group, a digest of the prompt ids its samples trained on: the audit compares it with
        # the dataset row the group's uid names (samples that disagree show as several, joined).
        digests: dict[str, set[str]] = {}
        for t in collected.trajectories:
            ids = ",".join(map(str, t.prompt_ids)).encode()
            digests.setdefault(t.group_uid, set()).add(hashlib.sha256(ids).hexdigest()[:16])
        row["prompt_digests"] = {g: ",".join(sorted(digests.get(g, set()))) for g in collected.groups}
        if self.filter_groups.enable:  # consumed, not trained: dynamic sampling dropped them
            row["filtered"] = dict(collected.filtered)
            row["filtered_prompts"] = [index_of(g) for g in collected.filtered]
        self.groups_path.parent.mkdir(parents=True, exist_ok=True)
        with self.groups_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    async def _validate(self, w: RunWiring, step: int, log: bool = False) -> dict[str, float]:
        """Validation metrics; ``log``: to the sinks now (outside a step; a step logs its own)."""
        assert self.val_set is not None
        prev, self.state.phase = self.state.phase, "VALIDATING"
        live = await w.push.live_engines()
        rollout = self.cfg.actor_rollout_ref.rollout
        result = await run_validation(
            self.val_set.items,
            replicas=[r.grpc_address for r in live],
            score=w.reward.score,
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
            await self._log_metrics(w, step, metrics)
        failed = f", {result.failures.summary()}" if result.failures.failed else ""
        self.progress(f"validation after step {step}: val/score {metrics['val/score']:.3f}{failed}")
        return metrics

    async def _checkpoint(self, w: RunWiring, step: int, final: bool = False) -> str:
        self.state.phase = "CHECKPOINTING"
        path = str(self.checkpoint_root / f"global_step_{step}")
        extra = {
            "step": step,
            "version": self.state.version,
            "kl_ctrl": self.kl_ctrl.state_dict(),
            **w.feeder.state_dict(),  # the data cursor and the prompts in flight
            "used_uids": sorted(u for uids in self.used_window for u in uids),
            "run_id": self.keys.run_id,
            # Only those a sample within max_staleness of this version could still carry.
            "refused_versions": [
                r for r in self.refused_versions if r[1] >= self.state.version - self.cfg.rlmesh.max_staleness
            ],
            "sampling": {
                "temperature": float(self.sampling.temperature),
                "top_p": float(self.sampling.top_p),
            },
        }
        t0 = time.monotonic()
        await self.rank_zero.run(
            RankCommand(
                "save",
                path=path,
                extra=json.loads(json.dumps(extra, default=_jsonable)),
                background=self.cfg.rlmesh.learner.async_checkpoint,
            )
        )
        if final or self.state.checkpoint_requests:  # whoever asked for it is told once it is whole
            await self.rank_zero.run(RankCommand("wait_for_checkpoint"))
        self.checkpoint_s = time.monotonic() - t0
        self.state.last_checkpoint = path
        self._prune_checkpoints()
        for _, fut in self.state.checkpoint_requests:
            if not fut.done():
                fut.set_result(path)
        self.state.checkpoint_requests.clear()
        return path

    def _prune_checkpoints(self) -> None:
        """Beyond the newest ``max_*_ckpt_to_keep`` complete ones (one being written in the
        background is not complete yet: it is counted by the next prune)."""
        trainer_cfg = self.cfg.trainer
        limits = [k for k in (trainer_cfg.max_actor_ckpt_to_keep, trainer_cfg.max_critic_ckpt_to_keep) if k]
        # A step's directory holds actor and critic together (a resume needs both): the larger
        # limit decides. Leftovers of saves that died half-way go too.
        for gone in prune_checkpoints(self.checkpoint_root, max(limits) if limits else None):
            log.info("removed checkpoint %s", gone)

    async def _export_actor(self, out_dir: str) -> None:
        """The trained actor as an HF directory at ``out_dir``, from memory, published whole (a
        directory beside it, then a rename). A failure is logged, not raised: the run is trained and
        its checkpoint saved, from which ``rlmesh export`` (or ``rlmesh train``) writes it."""
        out = Path(out_dir).expanduser()
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        self.state.phase = "CHECKPOINTING"  # the phases are the proto's: writing the actor is one
        self.progress(f"writing the actor to {out}")
        try:
            await self.rank_zero.run(RankCommand("export", path=str(tmp)))
            replace_dir(tmp, out)
        except Exception as e:
            log.error("could not write the actor to %s: %s", out, e)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        log.info("exported the actor to %s", out)


def _f32(value: float) -> float:
    return float(f"{value:.7g}")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint")
