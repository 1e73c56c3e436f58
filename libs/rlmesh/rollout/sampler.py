"""The sampler loop of a rollout replica: prompt tasks in, scored trajectories out.

docs/design.md#rollout-replica"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from prometheus_client import CollectorRegistry, Counter
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from rlmesh.engine.client import TOKEN_VERSIONS, EngineClient, EngineError
from rlmesh.queue.connection import TRANSIENT_ERRORS, retry_redis_with_deadline
from rlmesh.queue.gauges import RunQueueGauges, WatchedStream, keys_of_stream
from rlmesh.queue.partials import PartialSample, PartialStore
from rlmesh.queue.signing import expose_untrusted
from rlmesh.queue.streams import Delivery, QueueFullError, StreamQueue
from rlmesh.rollout.chunks import (
    RESUMED_TOKENS,
    as_output,
    chunk_params,
    chunk_problem,
    extend,
    resumed_from,
)
from rlmesh.rollout.resilience import CircuitBreaker, Stopped, call_until_ok, is_transient
from rlmesh.runtime.prometheus import MetricSet
from rlmesh.v1 import common_pb2, reference_pb2, reward_pb2, trajectory_pb2

log = logging.getLogger("rlmesh.rollout")

Traj = trajectory_pb2.Trajectory

ScoreFn = Callable[[list[reward_pb2.RewardSample]], Awaitable[list[reward_pb2.RewardResult]]]
RefFn = Callable[[list[reference_pb2.LogProbsSample]], Awaitable[list[reference_pb2.LogProbsResult]]]

SAMPLING_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "ignore_eos",
    "min_new_tokens",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "skip_special_tokens",
    "sampling_seed",
)


# What verl's ReMax changes for the greedy baseline (``apply_greedy_sampling_params``); the length
# limit, stop conditions and the rest stay the task's.
GREEDY_PARAMS = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "n": 1}


def sampling_dict(params: common_pb2.SamplingParams, defaults: dict[str, Any]) -> dict[str, Any]:
    """SGLang ``sampling_params`` from a task's proto (fields it set) over the replica's defaults.
    ValueError, naming the field, for a NaN or infinite number (JSON cannot carry one)."""
    out = dict(defaults)
    for name in SAMPLING_FIELDS:
        if params.HasField(name):
            value = getattr(params, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"sampling_params.{name}={value}: must be a finite number")
            out[name] = value
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    return out


def parse_version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0  # "default": the weights the engine started with


def token_versions(output: dict[str, Any]) -> list[int]:
    """The weight version of each output token, where the engine says (the embedded engine's
    ``TOKEN_VERSIONS``, one per token); else empty."""
    given = output["meta_info"].get(TOKEN_VERSIONS)
    if not isinstance(given, list) or len(given) != len(output["output_ids"]):
        return []
    return [parse_version(v) for v in given]


def oldest_version(output: dict[str, Any], versions: list[int], version_before: int) -> int:
    """The oldest weights that sampled any token of ``output``: its first token's, where the
    engine says per token; else the older of the version as generation started (``version_before``,
    0 when unknown) and the one the engine reports at the end."""
    if versions:
        return min(versions)
    at_end = parse_version(output["meta_info"].get("weight_version"))
    return min(version_before, at_end) if version_before else at_end


OUTCOMES = ("done", "failed", "interrupted")
DEPENDENCIES = ("engine", "reward", "reference", "trajectory_stream")
QUEUE_GAUGES_EVERY_S = 5.0  # how often the run's queue depths are read from Redis


def engine_gpus(server_info: dict[str, Any]) -> int:
    """Accelerators an engine computes on, from its /server_info: SGLang's tp x dp x pp unless its
    device is the CPU; the embedded engine runs on the CPU: 0."""
    if server_info.get("engine") == "embedded" or server_info.get("device") == "cpu":
        return 0
    sizes = (int(server_info.get(k) or 1) for k in ("tp_size", "dp_size", "pp_size"))
    return math.prod(sizes)


class BusyClock:
    """Wall time during which at least one of possibly overlapping spans was open, added to a
    counter as it passes (at each span's start and end): its rate is the busy fraction, and
    tokens over it the throughput while busy, idle time between waves left out."""

    def __init__(self, counter: Counter, clock: Callable[[], float] = time.monotonic) -> None:
        self.counter = counter
        self.clock = clock
        self.open = 0
        self._last = clock()

    def _tick(self) -> None:
        now = self.clock()
        if self.open:
            self.counter.inc(now - self._last)
        self._last = now

    def __enter__(self) -> BusyClock:
        self._tick()
        self.open += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._tick()
        self.open -= 1


class SamplerMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        series = MetricSet(registry)
        self.tasks = series.counter(
            "rlmesh_rollout_tasks", "Prompt tasks finished", ["outcome"], zero=OUTCOMES
        )
        self.trajectories = series.counter("rlmesh_rollout_trajectories", "Trajectories published")
        self.tokens = series.counter("rlmesh_rollout_generated_tokens", "Response tokens generated")
        self.stage = series.histogram(
            "rlmesh_rollout_stage_seconds",
            "Time per stage of a task",
            ["stage"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
        )
        self.retries = series.counter(
            "rlmesh_rollout_dependency_retries", "Failed calls retried", ["dependency"], zero=DEPENDENCIES
        )
        self.in_flight = series.gauge("rlmesh_rollout_tasks_in_flight", "Tasks being worked on")
        self.breaker_open = series.gauge(
            "rlmesh_rollout_breaker_open",
            "1 while a dependency's breaker is open",
            ["dependency"],
            zero=DEPENDENCIES[:3],
        )
        self.generating = series.counter(
            "rlmesh_rollout_generating_seconds",
            "Wall time with at least one engine generate call of this replica in flight",
        )
        self.engine_gpus = series.gauge(
            "rlmesh_rollout_engine_gpus", "GPUs (accelerators) the replica's engine computes on; 0: the CPU"
        )
        self.policy_version = series.gauge(
            "rlmesh_rollout_policy_version", "The weight version the replica's engine holds"
        )
        self.paused = series.gauge(
            "rlmesh_rollout_paused", "1 while the replica claims no work (paused or draining)"
        )
        self.resumed_samples = series.counter(
            "rlmesh_rollout_resumed_samples",
            "Samples taken over with tokens an earlier replica generated (partial rollouts)",
        )
        self.resumed_tokens = series.counter(
            "rlmesh_rollout_resumed_tokens", "Tokens taken over from an earlier replica, not generated again"
        )
        if registry is not None:  # what this replica read from Redis and did not trust
            expose_untrusted(registry)


@dataclass
class SamplerSettings:
    replica_id: str
    tasks_in_flight: int = 8
    claim_block_ms: int = 1000
    touch_interval_s: float = 10.0
    backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # Generate in calls of this many tokens, saving each sample's tokens with its task after each
    # (``partials``), so an interrupted generation goes on from them; 0: one call per request.
    partial_chunk_tokens: int = 0
    retryable: Callable[[BaseException], bool] = is_transient


class SamplerLoop:
    def __init__(
        self,
        *,
        prompts: StreamQueue[trajectory_pb2.PromptTask],
        trajectories: StreamQueue[trajectory_pb2.Trajectory],
        engine: EngineClient,
        score: ScoreFn,
        ref_logprobs: RefFn | None,
        settings: SamplerSettings,
        reward_breaker: CircuitBreaker,
        reference_breaker: CircuitBreaker,
        engine_breaker: CircuitBreaker | None = None,
        can_claim: Callable[[], Awaitable[bool]] | None = None,
        registry: CollectorRegistry | None = None,
        decode: Callable[[list[int]], str] | None = None,
        partials: PartialStore | None = None,
    ) -> None:
        if settings.partial_chunk_tokens and partials is None:
            raise ValueError("partial_chunk_tokens needs a PartialStore to save the samples in")
        self.partials = partials
        self.prompts = prompts
        self.trajectories = trajectories
        self.engine = engine
        self.score = score
        self.ref_logprobs = ref_logprobs
        self.settings = settings
        self.reward_breaker = reward_breaker
        self.reference_breaker = reference_breaker
        self.engine_breaker = engine_breaker or CircuitBreaker("engine")
        self.can_claim = can_claim
        # SGLang runs with --skip-tokenizer-init and returns no text: rule-based rewards need it.
        self.decode = decode
        self.metrics = SamplerMetrics(registry)
        self.observed = registry is not None
        self.generating = BusyClock(self.metrics.generating)
        self.policy_version = 0
        self.metrics.policy_version.set_function(lambda: self.policy_version)
        self.metrics.paused.set_function(lambda: int(self.paused))
        keys = keys_of_stream(prompts.stream) if registry is not None else None
        self.queue_gauges = (
            RunQueueGauges(
                prompts.redis,
                keys,
                [WatchedStream(q.stream, q.group) for q in (prompts, trajectories)],
                registry,
            )
            if keys is not None
            else None
        )
        self.tasks_done = 0
        self.tokens_generated = 0
        self._started = time.monotonic()
        self._claiming = asyncio.Event()  # cleared by pause()
        self._claiming.set()
        self._parked = asyncio.Event()  # set while no claim is in progress
        self._parked.set()
        self._stop = asyncio.Event()
        self._in_flight: dict[bytes, asyncio.Task[None]] = {}
        self._unchunked_logged: set[str] = set()
        self._request_ids = itertools.count(1)
        self._saved_here: set[str] = set()  # tasks whose samples this process saved (not resumed)

    # ----- control -----
    async def pause(self) -> None:
        """Stops claiming. On return no claim is in progress and none starts until ``resume``; tasks
        claimed before are in ``in_flight`` and finish. A claim blocked waiting for new tasks is
        woken rather than waited for, so this takes a round trip to Redis, not ``claim_block_ms``."""
        self._claiming.clear()
        if not self._parked.is_set():
            # With Redis unreachable the wake cannot be sent; the claim then ends on its own, after
            # claim_block_ms or with the same error.
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await self.prompts.interrupt()
            await self._parked.wait()

    def resume(self) -> None:
        self._claiming.set()

    @property
    def paused(self) -> bool:
        return not self._claiming.is_set()

    @property
    def claim_in_progress(self) -> bool:
        return not self._parked.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def tokens_per_s(self) -> float:
        return self.tokens_generated / max(1e-9, time.monotonic() - self._started)

    async def drain(self, timeout_s: float) -> int:
        """Stops claiming (``pause``) and waits for in-flight tasks; returns how many did not finish
        (they stay pending in Redis and another replica reclaims them)."""
        await self.pause()
        tasks = list(self._in_flight.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            return len(pending)
        return 0

    async def stop(self, timeout_s: float) -> int:
        """``drain`` for up to ``timeout_s``, then gives up on what is left: those tasks are
        cancelled and released to the queue, so other replicas take them over at once."""
        unfinished = await self.drain(timeout_s)
        self._stop.set()
        entries = list(self._in_flight)
        for task in self._in_flight.values():
            task.cancel()
        if entries:
            await asyncio.wait(list(self._in_flight.values()), timeout=5.0)
            try:
                await self.prompts.release(entries)
            except TRANSIENT_ERRORS as e:  # they are reclaimed after claim_idle_ms instead
                log.warning("could not release %d unfinished task(s): %s", len(entries), e)
        return unfinished

    # ----- the loop -----
    async def run(self) -> None:
        await retry_redis_with_deadline(self.prompts.ensure_group, "create prompt group")
        helpers = [asyncio.create_task(self._touch_forever())]
        if self.observed:  # the gauges are on a registry someone scrapes
            helpers.append(asyncio.create_task(self._observe_forever()))
        try:
            while not self._stop.is_set():
                await self._claiming.wait()
                room = self.settings.tasks_in_flight - len(self._in_flight)
                if room <= 0 or (self.can_claim is not None and not await self.can_claim()):
                    await self._wait_for_room()
                    continue
                if not self._claiming.is_set():
                    continue  # paused while can_claim() was asked
                try:
                    await self._claim(room)
                except TRANSIENT_ERRORS as e:
                    log.warning("claim failed, Redis unavailable: %s", e)
                    await asyncio.sleep(0.5)
        finally:
            for helper in helpers:
                helper.cancel()

    async def _claim(self, room: int) -> None:
        # Parked again only once what the claim returned is in flight: pause() then reports it.
        self._parked.clear()
        try:
            deliveries = await self.prompts.claim(room, block_ms=self.settings.claim_block_ms)
            if deliveries:
                # Everything one claim returned is one wave: generated, scored and published together.
                wave = asyncio.create_task(self._handle_wave(deliveries))
                for delivery in deliveries:
                    self._in_flight[delivery.entry_id] = wave
                wave.add_done_callback(lambda _t, ids=[d.entry_id for d in deliveries]: self._finished(ids))
            self.metrics.in_flight.set(len(self._in_flight))
        finally:
            self._parked.set()

    def _finished(self, entry_ids: list[bytes]) -> None:
        for entry_id in entry_ids:
            self._in_flight.pop(entry_id, None)
        # Acked or dead-lettered (the queue has forgotten them already), or given up on with Redis
        # unreachable: then they stay pending, and the queue must treat them as orphans to take
        # back, not as entries this process still works on.
        self.prompts.forget(entry_ids)
        self.metrics.in_flight.set(len(self._in_flight))

    async def _wait_for_room(self) -> None:
        if self._in_flight:
            await asyncio.wait(
                list(self._in_flight.values()), timeout=0.5, return_when=asyncio.FIRST_COMPLETED
            )
        else:
            await asyncio.sleep(0.2)

    async def _touch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.touch_interval_s)
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await self.prompts.touch(list(self._in_flight))

    async def _observe_forever(self) -> None:
        """Keeps the gauges read from outside: the engine's GPUs (once) and the run's queues."""
        gpus_known = False
        while True:
            if not gpus_known:
                try:
                    self.metrics.engine_gpus.set(engine_gpus(await self.engine.server_info()))
                    gpus_known = True
                except Exception as e:  # the engine is starting or busy: ask again next round
                    log.debug("engine server info unavailable: %s", e)
            if self.queue_gauges is not None:
                try:
                    await self.queue_gauges.refresh()
                except Exception as e:  # gauges only: never a reason to stop sampling
                    log.debug("queue gauges not refreshed: %s", e)
            await asyncio.sleep(QUEUE_GAUGES_EVERY_S)

    async def _handle_wave(self, deliveries: list[Delivery[trajectory_pb2.PromptTask]]) -> None:
        """One claim's tasks as one wave: one engine call per sampling setting (continuous batching
        sees them together), one ``Reward.Score`` and one ``Reference.LogProbs`` call, one stream
        write and one ack. A task that fails alone (its sampling params, the engine refusing it) is
        dead-lettered alone; what fails the whole wave (say, a reward answer of the wrong length)
        dead-letters the tasks still in it."""
        pending = {d.entry_id: d for d in deliveries}  # neither acked nor dead-lettered yet
        try:
            sampled = await self._sample_wave(deliveries, pending)
            await self._publish(sampled)
            acked = [d.entry_id for d, _ in sampled]
            await retry_redis_with_deadline(lambda: self.prompts.ack(acked), f"ack {len(acked)} task(s)")
            for entry_id in acked:
                pending.pop(entry_id)
            await self._drop_partials([d.message.uid for d, _ in sampled])
        except (Stopped, asyncio.CancelledError):
            # Not acked: they stay pending and are reclaimed by another replica.
            self.metrics.tasks.labels("interrupted").inc(len(pending))
            raise
        except Exception as e:
            # A bug, or an answer that cannot be used: retrying the same tasks cannot help, so they
            # go to the dead letters with the reason instead of blocking slots forever.
            log.exception("a wave of %d task(s) failed; dead-lettering them", len(pending))
            for delivery in list(pending.values()):
                await self._dead_letter(delivery, e, pending)
            return
        self.tasks_done += len(sampled)
        self.metrics.tasks.labels("done").inc(len(sampled))
        self.metrics.trajectories.inc(sum(len(trajs) for _, trajs in sampled))

    async def _dead_letter(
        self,
        delivery: Delivery[trajectory_pb2.PromptTask],
        error: BaseException,
        pending: dict[bytes, Delivery[trajectory_pb2.PromptTask]],
    ) -> None:
        if delivery.entry_id not in pending:
            return  # both of a task's engine calls (samples, greedy baseline) refused it
        pending.pop(delivery.entry_id)
        task = delivery.message
        log.error("task %s failed; dead-lettering it: %s", task.uid, error)
        self.metrics.tasks.labels("failed").inc()
        reason = f"failed: {type(error).__name__}: {error}"[:2000]
        await retry_redis_with_deadline(
            lambda: self.prompts.dead_letter_message(delivery.entry_id, task, reason, delivery.deliveries),
            f"dead-letter {task.uid}",
        )
        await self._drop_partials([task.uid])

    async def _drop_partials(self, task_uids: list[str]) -> None:
        """Forgets the saved samples of tasks that are done with; left behind (Redis unreachable),
        they expire."""
        if self.partials is not None:
            self._saved_here.difference_update(task_uids)
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await self.partials.drop(task_uids)

    async def _publish(self, sampled: list[tuple[Delivery[trajectory_pb2.PromptTask], list[Traj]]]) -> None:
        """Writes the wave's trajectories in as few stream writes as the stream's bound allows (one,
        unless the wave alone is larger than the bound). A full stream is back-pressure: wait for
        the learner to consume and try again (the tasks stay in flight, touched, so nobody reclaims
        them); never drop the samples."""
        chunks: list[list[Traj]] = [[]]
        for _, trajs in sampled:
            if chunks[-1] and len(chunks[-1]) + len(trajs) > self.trajectories.maxlen:
                chunks.append([])
            chunks[-1].extend(trajs)
        for chunk in chunks:
            if chunk:
                await self._put_waiting(chunk)

    async def _put_waiting(self, trajs: list[Traj]) -> None:
        what = f"publish {len(trajs)} trajectories"

        def log_full(state: RetryCallState) -> None:
            assert state.outcome is not None and state.next_action is not None
            self.metrics.retries.labels("trajectory_stream").inc()
            log.warning(
                "%s; waiting %.1f s for the learner to consume",
                state.outcome.exception(),
                state.next_action.sleep,
            )

        def stopped(state: RetryCallState) -> NoReturn:
            assert state.outcome is not None
            raise Stopped() from state.outcome.exception()

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(QueueFullError),
            wait=wait_exponential(multiplier=self.settings.backoff_s, max=self.settings.max_backoff_s),
            stop=lambda _: self._stop.is_set(),
            before_sleep=log_full,
            retry_error_callback=stopped,
        )
        await retrying(retry_redis_with_deadline, lambda: self.trajectories.put(trajs), what)

    async def _sample_wave(
        self,
        deliveries: list[Delivery[trajectory_pb2.PromptTask]],
        pending: dict[bytes, Delivery[trajectory_pb2.PromptTask]],
    ) -> list[tuple[Delivery[trajectory_pb2.PromptTask], list[Traj]]]:
        t0 = time.monotonic()
        now = time.time()
        # Keyed by (greedy baseline?, sampling params): a remax task is in two engine calls.
        groups: dict[tuple[bool, str], list[tuple[Delivery[trajectory_pb2.PromptTask], dict[str, Any]]]] = {}
        for delivery in deliveries:
            task = delivery.message
            try:
                params = {
                    **sampling_dict(task.sampling_params, self.settings.sampling_defaults),
                    "n": max(1, task.n),
                }
            except ValueError as e:
                await self._dead_letter(delivery, e, pending)
                continue
            groups.setdefault((False, json.dumps(params, sort_keys=True)), []).append((delivery, params))
            if task.greedy_baseline:
                greedy = {**params, **GREEDY_PARAMS}
                groups.setdefault((True, json.dumps(greedy, sort_keys=True)), []).append((delivery, greedy))
        if not groups:
            return []
        version_before = await self._engine_version()
        with self.generating:
            generated = await asyncio.gather(
                *(
                    self._generate_group(group, pending, label="/baseline" if is_baseline else "")
                    for (is_baseline, _), group in groups.items()
                )
            )
        t_gen = time.monotonic()
        self.metrics.stage.labels("generate").observe(t_gen - t0)
        baselines: dict[bytes, dict[str, Any]] = {}
        outputs = []
        for (is_baseline, _), group in zip(groups, generated, strict=True):
            for delivery, outs in group:
                if is_baseline:
                    baselines[delivery.entry_id] = outs[0]
                else:
                    outputs.append((delivery, outs))
        # A task the engine refused in either of its calls is dead-lettered: none of it is used.
        sampled = [
            (
                delivery,
                self._trajectories(delivery.message, outs, version_before, baselines.get(delivery.entry_id)),
            )
            for delivery, outs in outputs
            if delivery.entry_id in pending
        ]
        baseline_of = [
            (delivery, baselines[delivery.entry_id])
            for delivery, _ in sampled
            if delivery.message.greedy_baseline
        ]
        trajs = [traj for _, group_trajs in sampled for traj in group_trajs]
        if not trajs:
            return []
        tokens = sum(len(t.response_ids) for t in trajs) + sum(len(o["output_ids"]) for _, o in baseline_of)
        self.tokens_generated += tokens
        self.metrics.tokens.inc(tokens)

        # The greedy baselines are scored in the same call; they need no reference (no KL, as verl).
        reward_task = asyncio.create_task(self._scores(sampled, baseline_of))
        ref_task = asyncio.create_task(self._references(trajs)) if self.ref_logprobs else None
        (scores, reward_s), (refs, ref_s) = await asyncio.gather(
            reward_task, ref_task if ref_task else _none()
        )
        for traj, result in zip(trajs, scores[: len(trajs)], strict=True):
            traj.score = result.score
            traj.reward_extra.update(result.extra)
            if result.HasField("error") and result.error.code:
                traj.error.CopyFrom(result.error)
        by_task = {delivery.entry_id: group_trajs for delivery, group_trajs in sampled}
        for (delivery, _), result in zip(baseline_of, scores[len(trajs) :], strict=True):
            set_baseline(by_task[delivery.entry_id], result)
        if refs is not None:
            for traj, result in zip(trajs, refs, strict=True):
                if result.HasField("error") and result.error.code:
                    traj.error.CopyFrom(result.error)
                else:
                    traj.ref_log_probs.extend(result.log_probs)
        total = time.monotonic() - t0
        for delivery, group_trajs in sampled:
            enqueued = delivery.message.enqueued_unix_ms
            timings = trajectory_pb2.StageTimings(
                queue_wait_s=max(0.0, now - enqueued / 1000) if enqueued else 0.0,
                generate_s=t_gen - t0,
                reward_s=reward_s,
                reference_s=ref_s,
                total_s=total,
            )
            for traj in group_trajs:
                traj.timings.CopyFrom(timings)
        self.metrics.stage.labels("total").observe(total)
        return sampled

    def _trajectories(
        self,
        task: trajectory_pb2.PromptTask,
        outs: list[dict[str, Any]],
        version_before: int,
        baseline: dict[str, Any] | None = None,
    ) -> list[Traj]:
        # Tag with the oldest weights that took part (the greedy baseline's included: it sets the
        # advantages), so staleness is never under-counted.
        took_part = outs if baseline is None else [*outs, baseline]
        engine_version = min(parse_version(o["meta_info"].get("weight_version")) for o in took_part)
        versions = [token_versions(o) for o in took_part]
        version = min(oldest_version(o, v, version_before) for o, v in zip(took_part, versions, strict=True))
        self.policy_version = max(self.policy_version, engine_version)
        trajs = []
        for i, o in enumerate(outs):
            index = task.sample_offset + i
            meta = o["meta_info"]
            trajs.append(
                trajectory_pb2.Trajectory(
                    uid=f"{task.group_uid}/{index}",
                    group_uid=task.group_uid,
                    task_uid=task.uid,
                    sample_index=index,
                    prompt_ids=list(task.prompt_ids),
                    response_ids=o["output_ids"],
                    rollout_log_probs=[lp for lp, _, _ in meta.get("output_token_logprobs", [])],
                    finish_reason=str(meta["finish_reason"].get("type", "")),
                    policy_version=version,
                    token_policy_versions=versions[i],
                    resumed_tokens=int(meta.get(RESUMED_TOKENS, 0)),
                    replica_id=self.settings.replica_id,
                    response_text=self._text(o),
                    ground_truth=task.ground_truth,
                    data_source=task.data_source,
                    step=task.step,
                    validation=task.validation,
                )
            )
        return trajs

    def _text(self, output: dict[str, Any]) -> str:
        return output.get("text") or (self.decode(output["output_ids"]) if self.decode else "")

    async def _engine_version(self) -> int:
        """The engine's weight version as generation starts. The learner pushes to engines directly,
        so the version we last heard of may be behind; a tag from it would make fresh samples look
        stale (a synchronous run would then throw every batch away once and sample it again)."""
        try:
            info = await self.engine.model_info()
        except Exception as e:  # the generate call that follows retries and reports engine trouble
            log.debug("engine version unavailable (%s); using the last known %d", e, self.policy_version)
            return self.policy_version
        self.policy_version = max(self.policy_version, parse_version(info.get("weight_version")))
        return self.policy_version

    async def _generate_group(
        self,
        group: list[tuple[Delivery[trajectory_pb2.PromptTask], dict[str, Any]]],
        pending: dict[bytes, Delivery[trajectory_pb2.PromptTask]],
        label: str = "",
    ) -> list[tuple[Delivery[trajectory_pb2.PromptTask], list[dict[str, Any]]]]:
        """Tasks with the same sampling params in one engine call; each task's outputs (prompt-major,
        as SGLang answers a batch). If the engine refuses the call, each task is asked for alone, so
        only the one it refuses is dead-lettered. ``label`` tells the request ids of a task's
        greedy baseline from those of its samples."""
        params = group[0][1]
        try:
            if self._chunked(params, label):
                return await self._generate_partial(group, pending)
            tasks = [d.message for d, _ in group]
            outs = await self._generate([list(t.prompt_ids) for t in tasks], params, _name(tasks, label))
        except EngineError as e:
            if not e.rejected:
                raise
            if len(group) == 1:
                await self._dead_letter(group[0][0], e, pending)
                return []
            alone = await asyncio.gather(*(self._generate_group([item], pending, label) for item in group))
            return [item for one in alone for item in one]
        n = params["n"]
        if len(outs) != n * len(group):
            raise EngineError(
                f"{self.engine.name}: answered {len(outs)} outputs for {len(group)} prompt(s) x n={n}",
                status=500,
            )
        return [(delivery, outs[i * n : (i + 1) * n]) for i, (delivery, _) in enumerate(group)]

    async def _generate(
        self,
        prompts: list[list[int]],
        params: dict[str, Any],
        what: tuple[str, str],
        keep_aborted: bool = False,
    ) -> list[dict[str, Any]]:
        """Generates, retrying while the engine is unreachable or failing (5xx); a 4xx refusal of
        the request itself is raised at once. ``what``: the request named in messages, and the
        request id of a single prompt. An aborted sample is generated again, unless
        ``keep_aborted`` (the caller goes on from what it has)."""
        described, rid_base = what

        async def generate(_: None) -> list[dict[str, Any]]:
            if len(prompts) == 1:
                out = await self.engine.generate(prompts[0], params, return_logprob=True, rid=rid())
            else:
                # No rid: SGLang derives one per sequence of a batch, and the retry of a batch is a new one.
                out = await self.engine.generate(prompts, params, return_logprob=True)
            outs = out if isinstance(out, list) else [out]
            aborted = [o for o in outs if _finish_type(o) == "abort"]
            # Kept, a call whose every output is an abort that generated nothing would be made again
            # at once, forever: that one waits and retries like any engine failure.
            if keep_aborted and any(o["output_ids"] for o in outs):
                aborted = []
            if aborted:
                # Cut short (aborted by an operator, or by an engine failure): never trained on.
                raise EngineError(
                    f"{self.engine.name}: {len(aborted)} sample(s) of {described} were aborted "
                    f"({aborted[0]['meta_info']['finish_reason'].get('message', '')}); generating again",
                    status=503,
                )
            return outs

        # A fresh request id per attempt, unique in this process: the engine refuses one that is
        # still running, and a retry must not wait on (or be confused with) the request it
        # replaces, nor one chunk's call on another's.
        def rid() -> str:
            return f"{rid_base}#{next(self._request_ids)}"

        return await self._call(generate, None, self.engine_breaker, "engine")

    def _chunked(self, params: dict[str, Any], label: str) -> bool:
        """Whether samples of ``params`` are generated in chunks (and saved after each): partial
        rollouts are on, the request is longer than a chunk, and a cut changes nothing of its
        sampling. Greedy baselines are one call: one short sample, cheap to generate again."""
        chunk = self.settings.partial_chunk_tokens
        if not chunk or label or params.get("max_new_tokens", chunk + 1) <= chunk:
            return False
        problem = chunk_problem(params)
        if problem is not None and problem not in self._unchunked_logged:
            self._unchunked_logged.add(problem)
            log.warning("generating in one call, not in chunks of %d tokens: %s", chunk, problem)
        return problem is None

    async def _generate_partial(
        self,
        group: list[tuple[Delivery[trajectory_pb2.PromptTask], dict[str, Any]]],
        pending: dict[bytes, Delivery[trajectory_pb2.PromptTask]],
    ) -> list[tuple[Delivery[trajectory_pb2.PromptTask], list[dict[str, Any]]]]:
        """``_generate_group`` in chunks: each task starts from the samples saved with it (a task
        taken over goes on from where its earlier holder was); each round asks the engine for the
        next chunk of every sample not complete, adds it, and saves the samples of the tasks that
        have any. An abort keeps what it generated."""
        params = group[0][1]
        limit, n = params["max_new_tokens"], params["n"]
        samples = await self._load_partials([d for d, _ in group], limit, n)
        while True:
            live = [d for d, _ in group if d.entry_id in pending]  # one may be dead-lettered meanwhile
            calls = self._chunk_calls(live, samples, params)
            if not calls:
                return [(d, [as_output(s) for s in samples[d.entry_id]]) for d in live]
            version_before = await self._engine_version()
            answers = await _gather_or_cancel([call for _, call in calls])
            for (targets, _), outs in zip(calls, answers, strict=True):
                if len(outs) != len(targets):
                    raise EngineError(
                        f"{self.engine.name}: answered {len(outs)} outputs for {len(targets)} samples",
                        status=500,
                    )
                for sample, out in zip(targets, outs, strict=True):
                    versions = token_versions(out) or [oldest_version(out, [], version_before)] * len(
                        out["output_ids"]
                    )
                    extend(sample, out, versions, limit)
            await asyncio.gather(
                *(
                    self._save_partials(d.message.uid, samples[d.entry_id])
                    for d in live
                    if samples[d.entry_id]
                )
            )

    async def _load_partials(
        self, deliveries: list[Delivery[trajectory_pb2.PromptTask]], limit: int, n: int
    ) -> dict[bytes, list[PartialSample]]:
        """Each task's ``n`` samples to go on with: what is saved for it (read on every delivery: a
        replica restarted under its old name reads its pending tasks back, and Redis need not count
        that as a delivery), else new ones. Saved by another process, they count as resumed.
        Redis unreachable: generated from the start."""
        assert self.partials is not None
        partials = self.partials

        async def load(uid: str) -> dict[int, PartialSample]:
            try:
                return await partials.load(uid, limit)
            except TRANSIENT_ERRORS as e:
                log.warning("saved samples of %s unreadable (%s); generating them from the start", uid, e)
                return {}

        saved_of = await asyncio.gather(*(load(d.message.uid) for d in deliveries))
        out = {}
        for delivery, saved in zip(deliveries, saved_of, strict=True):
            taken_over = delivery.message.uid not in self._saved_here
            out[delivery.entry_id] = [resumed_from(saved.get(i), taken_over) for i in range(n)]
            if taken_over:
                kept = [len(s.output_ids) for s in out[delivery.entry_id] if s.output_ids]
                self.metrics.resumed_samples.inc(len(kept))
                self.metrics.resumed_tokens.inc(sum(kept))
        return out

    def _chunk_calls(
        self,
        live: list[Delivery[trajectory_pb2.PromptTask]],
        samples: dict[bytes, list[PartialSample]],
        params: dict[str, Any],
    ) -> list[tuple[list[PartialSample], Awaitable[list[dict[str, Any]]]]]:
        """The engine calls of one round, each with the samples its outputs extend, in order: the
        tasks not started in one call with their ``n`` (prompt-major, as SGLang answers), the other
        samples not complete as prompt + tokens so far, one call per chunk's params."""
        chunk = self.settings.partial_chunk_tokens
        calls: list[tuple[list[PartialSample], Awaitable[list[dict[str, Any]]]]] = []
        fresh = [d for d in live if not any(s.output_ids or s.finish_reason for s in samples[d.entry_id])]
        if fresh:
            tasks = [d.message for d in fresh]
            first = {**chunk_params(params, PartialSample(), chunk), "n": params["n"]}
            calls.append(
                (
                    [s for d in fresh for s in samples[d.entry_id]],
                    self._generate(
                        [list(t.prompt_ids) for t in tasks], first, _name(tasks, ""), keep_aborted=True
                    ),
                )
            )
        by_params: dict[str, list[tuple[Delivery[trajectory_pb2.PromptTask], PartialSample]]] = {}
        for d in live:
            if d in fresh:
                continue
            for s in samples[d.entry_id]:
                if not s.finish_reason:
                    by_params.setdefault(
                        json.dumps(chunk_params(params, s, chunk), sort_keys=True), []
                    ).append((d, s))
        for key, items in by_params.items():
            tasks = [d.message for d, _ in items]
            calls.append(
                (
                    [s for _, s in items],
                    self._generate(
                        [[*d.message.prompt_ids, *s.output_ids] for d, s in items],
                        json.loads(key),
                        _name(tasks, "/more"),
                        keep_aborted=True,
                    ),
                )
            )
        return calls

    async def _save_partials(self, task_uid: str, samples: list[PartialSample]) -> None:
        """Saves a task's samples if any has tokens; Redis unreachable: they go unsaved this round
        (only a takeover loses by it), and generation goes on."""
        assert self.partials is not None
        if not any(s.output_ids for s in samples):
            return
        try:
            await self.partials.save(task_uid, dict(enumerate(samples)))
            self._saved_here.add(task_uid)
        except TRANSIENT_ERRORS as e:
            log.warning("samples of %s not saved (%s); generation goes on", task_uid, e)

    async def _scores(
        self,
        sampled: list[tuple[Delivery[trajectory_pb2.PromptTask], list[Traj]]],
        baselines: Sequence[tuple[Delivery[trajectory_pb2.PromptTask], dict[str, Any]]] = (),
    ) -> tuple[list[reward_pb2.RewardResult], float]:
        """Results of every trajectory, in order, then of every greedy baseline (uid
        ``<group_uid>/baseline``), in one ``Reward.Score`` call."""

        def sample(
            task: trajectory_pb2.PromptTask, uid: str, ids: Sequence[int], text: str
        ) -> reward_pb2.RewardSample:
            return reward_pb2.RewardSample(
                uid=uid,
                prompt_text=task.prompt_text,
                prompt_ids=task.prompt_ids,
                response_text=text,
                response_ids=ids,
                ground_truth=task.ground_truth,
                data_source=task.data_source,
                extra_info_json=task.extra_info_json,
            )

        samples = [
            sample(delivery.message, t.uid, t.response_ids, t.response_text)
            for delivery, trajs in sampled
            for t in trajs
        ]
        samples += [
            sample(d.message, f"{d.message.group_uid}/baseline", o["output_ids"], self._text(o))
            for d, o in baselines
        ]
        t0 = time.monotonic()
        results = await self._call(self.score, samples, self.reward_breaker, "reward")
        if len(results) != len(samples):
            raise RuntimeError(f"reward answered {len(results)} results for {len(samples)} samples")
        self.metrics.stage.labels("reward").observe(time.monotonic() - t0)
        return results, time.monotonic() - t0

    async def _references(
        self, trajs: Sequence[trajectory_pb2.Trajectory]
    ) -> tuple[list[reference_pb2.LogProbsResult], float]:
        assert self.ref_logprobs is not None
        samples = [
            reference_pb2.LogProbsSample(uid=t.uid, prompt_ids=t.prompt_ids, response_ids=t.response_ids)
            for t in trajs
        ]
        t0 = time.monotonic()
        results = await self._call(self.ref_logprobs, samples, self.reference_breaker, "reference")
        if len(results) != len(samples):
            raise RuntimeError(f"reference answered {len(results)} results for {len(samples)} samples")
        self.metrics.stage.labels("reference").observe(time.monotonic() - t0)
        return results, time.monotonic() - t0

    async def _call(
        self, fn: Callable[[Any], Awaitable[Any]], samples: Any, breaker: CircuitBreaker, name: str
    ) -> Any:
        def on_retry(_e: BaseException) -> None:
            self.metrics.retries.labels(name).inc()
            self.metrics.breaker_open.labels(name).set(1 if breaker.opened_at is not None else 0)

        result = await call_until_ok(
            lambda: fn(samples),
            breaker=breaker,
            retryable=self.settings.retryable,
            stop=self._stop,
            backoff_s=self.settings.backoff_s,
            max_backoff_s=self.settings.max_backoff_s,
            on_retry=on_retry,
        )
        self.metrics.breaker_open.labels(name).set(0)
        return result


def set_baseline(trajs: Sequence[Traj], result: reward_pb2.RewardResult) -> None:
    """The greedy baseline's score on each trajectory of its task; a baseline the reward service
    could not score fails them all (ReMax cannot train them without it)."""
    for traj in trajs:
        if result.HasField("error") and result.error.code:
            if not traj.HasField("error"):
                traj.error.CopyFrom(result.error)
                traj.error.message = f"greedy baseline: {result.error.message}"
        else:
            traj.baseline_score = result.score


async def _gather_or_cancel(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    """``asyncio.gather``, but the first failure cancels the calls still running: a retry must not
    race requests of the attempt it replaces."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _name(tasks: Sequence[trajectory_pb2.PromptTask], label: str) -> tuple[str, str]:
    """A generate request of ``tasks`` as named in messages, and its request id (before the attempt)."""
    what = tasks[0].uid if len(tasks) == 1 else f"{len(tasks)} tasks ({tasks[0].uid}, ...)"
    return what, f"{tasks[0].uid}{label}"


def _finish_type(output: dict[str, Any]) -> str:
    reason = output.get("meta_info", {}).get("finish_reason") or {}
    return str(reason.get("type", "")) if isinstance(reason, dict) else str(reason)


async def _none() -> tuple[None, float]:
    return None, 0.0
