"""``RewardScorer`` scores a batch of ``RewardSample`` messages without gRPC, so the reward service,
the learner and tests all use the same code. A sample that cannot be scored gets
``RewardResult.error`` and the rest of the batch is unaffected."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from rlmesh.reward.builtin import builtin_for, data_source_rules
from rlmesh.reward.frames import describe_raise
from rlmesh.reward.function_loader import RewardFunction, builtin_function, configured_function
from rlmesh.reward.managers import RewardManager, reward_manager_from_config
from rlmesh.reward.metrics import RewardMetrics
from rlmesh.reward.pool import describe, guard_async, guard_sync, wait_until
from rlmesh.reward.samples import policy_tokenizer, prompt_text, sample_inputs, validate_batch
from rlmesh.reward.values import NotAScore, read_score
from rlmesh.runtime.threads import DaemonPool
from rlmesh.v1 import common_pb2, reward_pb2

if TYPE_CHECKING:
    from rlmesh.config import RLMeshConfig
    from rlmesh.reward.model import RewardModelScorer

log = logging.getLogger("rlmesh.reward")

ErrorCode = common_pb2.ErrorCode
DEFAULT_MAX_BATCH_SIZE = 1024
DEFAULT_MAX_WORKERS = 32


class RewardScorer:
    """Scores with the reward model when given; else with ``function`` for every sample; else with the
    built-in each sample's ``data_source`` picks. Sync functions run on a pool of daemon threads, async
    ones on the loop; each sample has ``timeout_s``. At most ``max_concurrency`` calls score at once.
    ``manager`` shapes what a function returned (verl's reward manager); a reward model's scores stand
    as they are, as verl's managers pass a reward model's scores through."""

    def __init__(
        self,
        function: RewardFunction | None = None,
        *,
        model: RewardModelScorer | None = None,
        timeout_s: float = 60.0,
        max_concurrency: int = 64,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_workers: int = DEFAULT_MAX_WORKERS,
        tokenizer: Any = None,
        vocab_size: int | None = None,
        registry: CollectorRegistry | None = None,
        manager: RewardManager | None = None,
    ) -> None:
        if timeout_s <= 0 or max_concurrency < 1 or max_batch_size < 1 or max_workers < 1:
            raise ValueError("timeout_s, max_concurrency, max_batch_size and max_workers must be positive")
        self.function = function
        self.model = model
        self.manager = manager or RewardManager()
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.max_batch_size = max_batch_size
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else (len(tokenizer) if tokenizer else None)
        self.metrics = RewardMetrics(registry if registry is not None else CollectorRegistry())
        self._pool = DaemonPool(max_workers, "reward-fn")
        # The reward model runs on its own thread: one forward at a time, never behind user functions.
        self._model_pool = DaemonPool(1, "reward-model")
        self._semaphore: asyncio.Semaphore | None = None
        self._builtins: dict[str, RewardFunction] = {}

    @classmethod
    def from_config(
        cls,
        cfg: RLMeshConfig,
        *,
        registry: CollectorRegistry | None = None,
        forced: str | None = None,
        timeout_s: float | None = None,
        max_batch_size: int | None = None,
        max_workers: int | None = None,
        load_tokenizer: bool = True,
    ) -> RewardScorer:
        """From ``reward_model.*``, ``custom_reward_function.*`` and ``rlmesh.reward.*``; an argument left
        None is its ``rlmesh.reward`` key (``forced``: ``function``). Raises ``RewardFunctionLoadError``
        when the function cannot be used (or the overlong penalty's settings cannot)."""
        section = cfg.rlmesh.reward
        function, model = None, None
        manager = reward_manager_from_config(cfg)
        if cfg.reward_model.enable:
            if manager.overlong is not None:
                log.warning(
                    "reward_model.enable: the reward model's scores are used as they are, without the "
                    "overlong penalty (as verl's dapo manager does)"
                )
            from rlmesh.reward.model import load_reward_model

            model = load_reward_model(cfg.reward_model)
        else:
            function = configured_function(cfg.custom_reward_function, forced or section.function)
        return cls(
            function,
            model=model,
            timeout_s=timeout_s or section.function_timeout_s or section.timeout_s,
            max_concurrency=section.max_concurrency,
            max_batch_size=max_batch_size or section.max_batch_size,
            max_workers=max_workers or section.workers,
            tokenizer=policy_tokenizer(cfg.tokenizer_path()) if load_tokenizer else None,
            registry=registry,
            manager=manager,
        )

    def functions(self) -> list[str]:
        """``data_source=function`` for each function served (``*`` when one scores every sample)."""
        if self.model is not None:
            return [f"*=reward_model:{self.model.path}"]
        if self.function is not None:
            return [f"*={self.function.name}"]
        return data_source_rules()

    def info(self) -> reward_pb2.RewardInfo:
        return reward_pb2.RewardInfo(
            functions=self.functions(),
            max_batch_size=self.max_batch_size,
            max_concurrency=self.max_concurrency,
        )

    def function_for(self, data_source: str) -> RewardFunction | None:
        if self.function is not None:
            return self.function
        name = builtin_for(data_source)
        if name is None:
            return None
        if name not in self._builtins:
            self._builtins[name] = builtin_function(name)
        return self._builtins[name]

    def validate(self, samples: Sequence[reward_pb2.RewardSample]) -> None:
        """Raises ``InvalidRequestError`` naming what is wrong with the batch."""
        validate_batch(samples, self.max_batch_size, self.vocab_size)

    async def score(
        self, samples: Sequence[reward_pb2.RewardSample], *, timeout_s: float | None = None
    ) -> list[reward_pb2.RewardResult]:
        """One ``RewardResult`` per sample, in order. ``timeout_s`` bounds the whole call (waiting for
        the concurrency limit included); samples still running then get TIMEOUT errors."""
        self.validate(samples)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s is not None else None
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        self.metrics.waiting.inc()
        try:
            await self._semaphore.acquire()
        finally:
            self.metrics.waiting.dec()
        try:
            self.metrics.batch_size.observe(len(samples))
            if self.model is not None:
                results = await self._score_with_model(samples, deadline)
            else:
                results = await self._score_functions(samples, deadline)
        finally:
            self._semaphore.release()
        failed = [r for r in results if r.HasField("error")]
        if failed:  # one line per call, not one per sample
            log.warning(
                "%d of %d samples could not be scored; first: %s",
                len(failed),
                len(results),
                failed[0].error.message,
                extra={"reasons": sorted({ErrorCode.Name(r.error.code) for r in failed})},
            )
        return results

    def _remaining(self, deadline: float | None) -> float:
        if deadline is None:
            return self.timeout_s
        return min(self.timeout_s, deadline - asyncio.get_running_loop().time())

    def _fail(
        self, sample: reward_pb2.RewardSample, function: str, code: int, what: str
    ) -> reward_pb2.RewardResult:
        message = f"sample uid={sample.uid!r} data_source={sample.data_source!r}: {what}"
        reason = ErrorCode.Name(code).removeprefix("ERROR_CODE_").lower()
        self.metrics.samples.labels(function).inc()
        self.metrics.errors.labels(reason, function).inc()
        error = common_pb2.SampleError(code=code, message=message, source=f"reward:{function}")
        return reward_pb2.RewardResult(uid=sample.uid, error=error)

    def _ok(
        self, sample: reward_pb2.RewardSample, function: str, score: float, extra: Mapping[str, float]
    ) -> reward_pb2.RewardResult:
        self.metrics.samples.labels(function).inc()
        self.metrics.scores.labels(function).observe(score)
        return reward_pb2.RewardResult(uid=sample.uid, score=score, extra=extra)

    def _convert(self, sample: reward_pb2.RewardSample, function: str, value: Any) -> reward_pb2.RewardResult:
        try:
            score, extra = read_score(value, function)
        except NotAScore as e:
            return self._fail(sample, function, e.code, str(e))
        if self.model is None:
            score, extra = self.manager.shape(value, score, extra, len(sample.response_ids))
        return self._ok(sample, function, score, extra)

    def _start(self, fn: RewardFunction, sample: reward_pb2.RewardSample, solution: str, extra_info: Any):
        """Starts one function call: an asyncio future of (value, seconds)."""
        call = functools.partial(fn.call, sample.data_source, solution, sample.ground_truth, extra_info)
        if fn.is_async:
            return asyncio.ensure_future(guard_async(call()))
        return asyncio.wrap_future(self._pool.submit(guard_sync, call))

    async def _score_functions(
        self, samples: Sequence[reward_pb2.RewardSample], deadline: float | None
    ) -> list[reward_pb2.RewardResult]:
        """Starts every sample's function at once and waits for all of them together: each sample has
        the same ``timeout`` from its start, so one wait is the same as one per sample, and cheaper."""
        timeout = self._remaining(deadline)
        if timeout <= 0:
            return [
                self._fail(
                    s, "none", ErrorCode.ERROR_CODE_TIMEOUT, "the call's deadline passed before scoring"
                )
                for s in samples
            ]
        results: list[reward_pb2.RewardResult | None] = [None] * len(samples)
        running: dict[asyncio.Future[Any], tuple[int, RewardFunction]] = {}
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        try:
            for i, sample in enumerate(samples):
                fn = self.function_for(sample.data_source)
                if fn is None:
                    results[i] = self._fail(
                        sample,
                        "none",
                        ErrorCode.ERROR_CODE_INVALID_INPUT,
                        f"no reward function for this data_source; this service serves: {', '.join(self.functions())}",
                    )
                    continue
                try:
                    solution, extra_info = sample_inputs(sample, self.tokenizer)
                except ValueError as e:
                    results[i] = self._fail(sample, fn.name, ErrorCode.ERROR_CODE_INVALID_INPUT, str(e))
                    continue
                try:
                    running[self._start(fn, sample, solution, extra_info)] = (i, fn)
                except Exception as e:  # an async function that raised before returning its coroutine
                    results[i] = self._fail(
                        sample,
                        fn.name,
                        ErrorCode.ERROR_CODE_FUNCTION_FAILED,
                        describe_raise(fn.name, e, fn.source_file()),
                    )
            while running:
                done, _ = await asyncio.wait(running, timeout=max(end - loop.time(), 0.0))
                if not done:
                    break
                for future in done:
                    i, fn = running.pop(future)
                    try:
                        value, seconds = future.result()
                    except Exception as e:
                        results[i] = self._fail(
                            samples[i],
                            fn.name,
                            ErrorCode.ERROR_CODE_FUNCTION_FAILED,
                            describe_raise(fn.name, e, fn.source_file()),
                        )
                        continue
                    self.metrics.function_seconds.labels(fn.name).observe(seconds)
                    if inspect.isawaitable(value):  # a sync function that returned a coroutine
                        running[asyncio.ensure_future(guard_async(value))] = (i, fn)
                    else:
                        results[i] = self._convert(samples[i], fn.name, value)
            for future, (i, fn) in running.items():
                future.cancel()  # a sync call already running on a thread finishes unobserved
                results[i] = self._fail(
                    samples[i],
                    fn.name,
                    ErrorCode.ERROR_CODE_TIMEOUT,
                    f"reward function {fn.name} did not finish within {timeout:.3g} s",
                )
            running.clear()
        finally:
            for future in running:  # cancelled ourselves (the caller went away): stop what we started
                future.cancel()
        return [r for r in results if r is not None]

    async def _score_with_model(
        self, samples: Sequence[reward_pb2.RewardSample], deadline: float | None
    ) -> list[reward_pb2.RewardResult]:
        assert self.model is not None
        name = "reward_model"
        results: list[reward_pb2.RewardResult | None] = [None] * len(samples)
        todo: list[int] = []
        prompts: list[str] = []
        responses: list[str] = []
        for i, sample in enumerate(samples):
            try:
                solution, _ = sample_inputs(sample, self.tokenizer)
            except ValueError as e:
                results[i] = self._fail(sample, name, ErrorCode.ERROR_CODE_INVALID_INPUT, str(e))
                continue
            todo.append(i)
            prompts.append(prompt_text(sample, self.tokenizer))
            responses.append(solution)
        if todo:
            timeout = self._remaining(deadline)
            model = self.model
            loop = asyncio.get_running_loop()
            future = asyncio.wrap_future(
                self._model_pool.submit(guard_sync, lambda: model.score(prompts, responses))
            )
            started = time.perf_counter()
            code = ErrorCode.ERROR_CODE_TIMEOUT
            failure = f"the reward model did not finish within {timeout:.3g} s"
            try:
                finished, outcome = await wait_until(future, loop.time() + max(timeout, 0.0))
                scores = outcome[0] if finished else None
            except Exception as e:
                finished, scores = False, None
                code, failure = (
                    ErrorCode.ERROR_CODE_FUNCTION_FAILED,
                    f"the reward model raised {describe(e)}",
                )
            finally:
                self.metrics.function_seconds.labels(name).observe(time.perf_counter() - started)
            for k, i in enumerate(todo):
                if not finished or scores is None:
                    results[i] = self._fail(samples[i], name, code, failure)
                else:
                    results[i] = self._convert(samples[i], name, scores[k])
        return [r for r in results if r is not None]

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown()
        self._model_pool.shutdown()
