"""The sampler loop of a rollout replica: prompt tasks in, scored trajectories out.

docs/design.md#rollout-replica"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rlmesh.engine.client import EngineClient, EngineError
from rlmesh.queue.connection import TRANSIENT_ERRORS, retry_forever
from rlmesh.queue.streams import Delivery, QueueFullError, StreamQueue
from rlmesh.rollout.resilience import CircuitBreaker, Stopped, call_until_ok, is_transient
from rlmesh.v1 import common_pb2, reference_pb2, reward_pb2, trajectory_pb2

log = logging.getLogger("rlmesh.rollout")

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


class SamplerMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.tasks = Counter("rlmesh_rollout_tasks", "Prompt tasks finished", ["outcome"], registry=registry)
        self.trajectories = Counter(
            "rlmesh_rollout_trajectories", "Trajectories published", registry=registry
        )
        self.tokens = Counter(
            "rlmesh_rollout_generated_tokens", "Response tokens generated", registry=registry
        )
        self.stage = Histogram(
            "rlmesh_rollout_stage_seconds",
            "Time per stage of a task",
            ["stage"],
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
        )
        self.retries = Counter(
            "rlmesh_rollout_dependency_retries", "Failed calls retried", ["dependency"], registry=registry
        )
        self.in_flight = Gauge("rlmesh_rollout_tasks_in_flight", "Tasks being worked on", registry=registry)
        self.breaker_open = Gauge(
            "rlmesh_rollout_breaker_open",
            "1 while a dependency's breaker is open",
            ["dependency"],
            registry=registry,
        )


@dataclass
class SamplerSettings:
    replica_id: str
    tasks_in_flight: int = 8
    claim_block_ms: int = 1000
    touch_interval_s: float = 10.0
    backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
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
    ) -> None:
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
        self.policy_version = 0
        self.tasks_done = 0
        self.tokens_generated = 0
        self._started = time.monotonic()
        self._claiming = asyncio.Event()  # cleared by pause()
        self._claiming.set()
        self._parked = asyncio.Event()  # set while no claim is in progress
        self._parked.set()
        self._stop = asyncio.Event()
        self._in_flight: dict[bytes, asyncio.Task[None]] = {}

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
        await retry_forever(self.prompts.ensure_group, "create prompt group")
        toucher = asyncio.create_task(self._touch_forever())
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
            toucher.cancel()

    async def _claim(self, room: int) -> None:
        # Parked again only once what the claim returned is in flight: pause() then reports it.
        self._parked.clear()
        try:
            deliveries = await self.prompts.claim(room, block_ms=self.settings.claim_block_ms)
            for delivery in deliveries:
                task = asyncio.create_task(self._handle(delivery))
                self._in_flight[delivery.entry_id] = task
                task.add_done_callback(lambda _t, eid=delivery.entry_id: self._finished(eid))
            self.metrics.in_flight.set(len(self._in_flight))
        finally:
            self._parked.set()

    def _finished(self, entry_id: bytes) -> None:
        self._in_flight.pop(entry_id, None)
        # Acked or dead-lettered (the queue has forgotten it already), or given up on with Redis
        # unreachable: then it stays pending, and the queue must treat it as an orphan to take
        # back, not as an entry this process still works on.
        self.prompts.forget([entry_id])

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

    async def _handle(self, delivery: Delivery[trajectory_pb2.PromptTask]) -> None:
        task = delivery.message
        try:
            trajectories = await self._sample(task)
            await self._publish(task, trajectories)
            await retry_forever(lambda: self.prompts.ack([delivery.entry_id]), f"ack {task.uid}")
        except (Stopped, asyncio.CancelledError):
            # Not acked: it stays pending and is reclaimed by another replica.
            self.metrics.tasks.labels("interrupted").inc()
            raise
        except Exception as e:
            # The engine refused the task, or a bug: retrying the same task cannot help, so it goes
            # to the dead letters with the reason instead of blocking a slot forever.
            log.exception("task %s failed; dead-lettering it", task.uid)
            self.metrics.tasks.labels("failed").inc()
            reason = f"failed: {type(e).__name__}: {e}"[:2000]
            await retry_forever(
                lambda: self.prompts.dead_letter(
                    delivery.entry_id, task.SerializeToString(), reason, delivery.deliveries
                ),
                f"dead-letter {task.uid}",
            )
            return
        self.tasks_done += 1
        self.metrics.tasks.labels("done").inc()
        self.metrics.trajectories.inc(len(trajectories))

    async def _publish(
        self, task: trajectory_pb2.PromptTask, trajectories: list[trajectory_pb2.Trajectory]
    ) -> None:
        """A full trajectory stream is back-pressure: wait for the learner to consume and try
        again (the task stays in flight, touched, so nobody reclaims it); never drop the samples."""
        delay = self.settings.backoff_s
        while True:
            try:
                await retry_forever(lambda: self.trajectories.put(trajectories), f"publish {task.uid}")
                return
            except QueueFullError as e:
                if self._stop.is_set():
                    raise Stopped() from e
                self.metrics.retries.labels("trajectory_stream").inc()
                log.warning("task %s: %s; waiting %.1f s for the learner to consume", task.uid, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.max_backoff_s)

    async def _sample(self, task: trajectory_pb2.PromptTask) -> list[trajectory_pb2.Trajectory]:
        t0 = time.monotonic()
        queue_wait = max(0.0, time.time() - task.enqueued_unix_ms / 1000) if task.enqueued_unix_ms else 0.0
        n = max(1, task.n)
        params = {**sampling_dict(task.sampling_params, self.settings.sampling_defaults), "n": n}
        version_before = await self._engine_version()
        out = await self._generate(task, params)
        outs = out if isinstance(out, list) else [out]
        t_gen = time.monotonic()
        self.metrics.stage.labels("generate").observe(t_gen - t0)
        # Tag with the oldest weights that took part, so staleness is never under-counted.
        engine_version = min(parse_version(o["meta_info"].get("weight_version")) for o in outs)
        version = min(version_before, engine_version) if version_before else engine_version
        self.policy_version = max(self.policy_version, engine_version)

        trajs = []
        for i, o in enumerate(outs):
            index = task.sample_offset + i
            meta = o["meta_info"]
            traj = trajectory_pb2.Trajectory(
                uid=f"{task.group_uid}/{index}",
                group_uid=task.group_uid,
                task_uid=task.uid,
                sample_index=index,
                prompt_ids=list(task.prompt_ids),
                response_ids=o["output_ids"],
                rollout_log_probs=[lp for lp, _, _ in meta.get("output_token_logprobs", [])],
                finish_reason=str(meta["finish_reason"].get("type", "")),
                policy_version=version,
                replica_id=self.settings.replica_id,
                response_text=o.get("text") or (self.decode(o["output_ids"]) if self.decode else ""),
                ground_truth=task.ground_truth,
                data_source=task.data_source,
                step=task.step,
                validation=task.validation,
            )
            trajs.append(traj)
        self.tokens_generated += sum(len(t.response_ids) for t in trajs)
        self.metrics.tokens.inc(sum(len(t.response_ids) for t in trajs))

        reward_task = asyncio.create_task(self._scores(task, trajs))
        ref_task = asyncio.create_task(self._references(trajs)) if self.ref_logprobs else None
        (scores, reward_s), (refs, ref_s) = await asyncio.gather(
            reward_task, ref_task if ref_task else _none()
        )
        for traj, result in zip(trajs, scores, strict=True):
            traj.score = result.score
            traj.reward_extra.update(result.extra)
            if result.HasField("error") and result.error.code:
                traj.error.CopyFrom(result.error)
        if refs is not None:
            for traj, result in zip(trajs, refs, strict=True):
                if result.HasField("error") and result.error.code:
                    traj.error.CopyFrom(result.error)
                else:
                    traj.ref_log_probs.extend(result.log_probs)
        total = time.monotonic() - t0
        for traj in trajs:
            traj.timings.CopyFrom(
                trajectory_pb2.StageTimings(
                    queue_wait_s=queue_wait,
                    generate_s=t_gen - t0,
                    reward_s=reward_s,
                    reference_s=ref_s,
                    total_s=total,
                )
            )
        self.metrics.stage.labels("total").observe(total)
        return trajs

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

    async def _generate(self, task: trajectory_pb2.PromptTask, params: dict[str, Any]) -> Any:
        """Generates, retrying while the engine is unreachable or failing (5xx); a 4xx refusal of
        the request itself is raised at once."""

        async def generate(_: None) -> Any:
            out = await self.engine.generate(list(task.prompt_ids), params, return_logprob=True, rid=rid())
            aborted = [o for o in (out if isinstance(out, list) else [out]) if _finish_type(o) == "abort"]
            if aborted:
                # Cut short (aborted by an operator, or by an engine failure): never trained on.
                raise EngineError(
                    f"{self.engine.name}: {len(aborted)} sample(s) of task {task.uid} were aborted "
                    f"({aborted[0]['meta_info']['finish_reason'].get('message', '')}); generating again",
                    status=503,
                )
            return out

        # A fresh request id per attempt: the engine refuses one that is still running, and a retry
        # must not wait on (or be confused with) the request it replaces.
        attempts = itertools.count(1)

        def rid() -> str:
            return f"{task.uid}#{next(attempts)}"

        return await self._call(generate, None, self.engine_breaker, "engine")

    async def _scores(
        self, task: trajectory_pb2.PromptTask, trajs: Sequence[trajectory_pb2.Trajectory]
    ) -> tuple[list[reward_pb2.RewardResult], float]:
        samples = [
            reward_pb2.RewardSample(
                uid=t.uid,
                prompt_text=task.prompt_text,
                prompt_ids=t.prompt_ids,
                response_text=t.response_text,
                response_ids=t.response_ids,
                ground_truth=task.ground_truth,
                data_source=task.data_source,
                extra_info_json=task.extra_info_json,
            )
            for t in trajs
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


def _finish_type(output: dict[str, Any]) -> str:
    reason = output.get("meta_info", {}).get("finish_reason") or {}
    return str(reason.get("type", "")) if isinstance(reason, dict) else str(reason)


async def _none() -> tuple[None, float]:
    return None, 0.0
