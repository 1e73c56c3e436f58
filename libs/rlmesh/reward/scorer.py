"""The reward scoring core: ``RewardScorer`` scores a batch of ``RewardSample`` messages without gRPC,
so the reward service, the learner and tests all use the same code.

What scores a sample, in this order: the reward model when one is given; else one function for every
sample (a forced built-in or the user's ``custom_reward_function``); else the built-in verl picks by
``data_source``. Sync functions run in a pool of daemon threads (a call stuck forever cannot hold up
process exit), async ones on the event loop; each sample has ``timeout_s`` (and the whole call the
caller's deadline). A sample whose function raises, times out,
or returns NaN/inf or a non-number gets ``RewardResult.error`` (FUNCTION_FAILED, TIMEOUT, NON_FINITE,
NOT_A_NUMBER; INVALID_INPUT for a sample that cannot be scored at all) and is counted in
``rlmesh_reward_sample_errors_total{reason}``; the rest of the batch is unaffected. A malformed batch
(empty, over ``max_batch_size``, token ids out of range) raises ``InvalidRequestError`` before any
scoring. At most ``max_concurrency`` calls score at once; more wait their turn.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import numbers
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rlmesh.reward.builtin import builtin_for
from rlmesh.reward.loader import (
    RewardFunction,
    RewardFunctionLoadError,
    builtin_function,
    load_reward_function,
)
from rlmesh.v1 import common_pb2, reward_pb2

if TYPE_CHECKING:
    from rlmesh.config import RLMeshConfig
    from rlmesh.reward.model import RewardModelScorer

log = logging.getLogger("rlmesh.reward")

ErrorCode = common_pb2.ErrorCode
SCORE_BUCKETS = (-10.0, -5.0, -2.0, -1.0, -0.5, -0.1, 0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SECONDS_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)
DEFAULT_MAX_BATCH_SIZE = 1024
DEFAULT_MAX_WORKERS = 32


class InvalidRequestError(ValueError):
    """The batch itself is malformed (gRPC INVALID_ARGUMENT); the message says what is wrong."""


class RewardMetrics:
    """Prometheus series of the reward core, registered into the service's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.samples = Counter(
            "rlmesh_reward_samples",
            "samples scored (with or without error), by function",
            ["function"],
            registry=registry,
        )
        self.errors = Counter(
            "rlmesh_reward_sample_errors",
            "samples that could not be scored, by reason and function",
            ["reason", "function"],
            registry=registry,
        )
        self.scores = Histogram(
            "rlmesh_reward_score",
            "scores of samples scored without error",
            ["function"],
            buckets=SCORE_BUCKETS,
            registry=registry,
        )
        self.function_seconds = Histogram(
            "rlmesh_reward_function_seconds",
            "time one reward function call took",
            ["function"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "rlmesh_reward_batch_size", "samples per scoring call", buckets=BATCH_BUCKETS, registry=registry
        )
        self.waiting = Gauge(
            "rlmesh_reward_calls_waiting",
            "scoring calls waiting for the concurrency limit",
            registry=registry,
        )


def _error(code: int, message: str, function: str) -> common_pb2.SampleError:
    return common_pb2.SampleError(code=code, message=message, source=f"reward:{function}")


def _as_float(value: Any) -> float | None:
    """A real number as float, else None (strings, None and containers are not numbers). numpy
    scalars and one-element arrays or tensors count, through their ``item()``."""
    if isinstance(value, bool | numbers.Real):
        try:
            return float(value)
        except (OverflowError, TypeError, ValueError):
            return None
    item = getattr(value, "item", None)
    if callable(item):
        try:
            inner = item()
        except Exception:
            return None
        if isinstance(inner, bool | numbers.Real):
            return _as_float(inner)
    return None


class DaemonPool:
    """A fixed pool of daemon threads. A reward function stuck forever cannot be stopped, but on
    daemon threads it cannot hold the process up at exit either (``ThreadPoolExecutor`` joins its
    threads at interpreter exit, so SIGTERM would wait for the stuck call)."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: pool is shut down")
            if not self._threads:
                for i in range(self.workers):
                    thread = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                    thread.start()
                    self._threads.append(thread)
        future: Future[Any] = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Cancels queued calls and lets idle threads end; running calls finish unobserved."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            self._queue.put(None)


class _Aborted(Exception):
    """A reward function raised SystemExit/KeyboardInterrupt: reported like any other failure, it
    must never stop the service (asyncio re-raises those out of the event loop)."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


def _guard_sync(call: Callable[[], Any]) -> tuple[Any, float]:
    """Runs a sync reward function on a pool thread: (value, seconds)."""
    started = time.perf_counter()
    try:
        return call(), time.perf_counter() - started
    except Exception:
        raise
    except BaseException as e:
        raise _Aborted(e) from e


async def _guard_async(awaitable: Awaitable[Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    try:
        return await awaitable, time.perf_counter() - started
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as e:
        raise _Aborted(e) from e


def _describe(exc: BaseException) -> str:
    original = exc.original if isinstance(exc, _Aborted) else exc
    return f"{type(original).__name__}: {original}"


class RewardScorer:
    """Scores ``reward_pb2.RewardSample`` batches; see the module docstring."""

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
    ) -> None:
        if timeout_s <= 0 or max_concurrency < 1 or max_batch_size < 1 or max_workers < 1:
            raise ValueError("timeout_s, max_concurrency, max_batch_size and max_workers must be positive")
        self.function = function
        self.model = model
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

    # -- construction from the config tree ---------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        cfg: RLMeshConfig,
        *,
        registry: CollectorRegistry | None = None,
        forced: str | None = None,
        timeout_s: float | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_workers: int = DEFAULT_MAX_WORKERS,
        load_tokenizer: bool = True,
    ) -> RewardScorer:
        """From ``reward_model.*``, ``custom_reward_function.*`` and ``rlmesh.reward.*``; ``forced`` names a
        built-in for every sample. Raises ``RewardFunctionLoadError`` when the function cannot be used."""
        function: RewardFunction | None = None
        model = None
        custom = cfg.custom_reward_function
        if cfg.reward_model.enable:
            from rlmesh.reward.model import RewardModelScorer

            rm = cfg.reward_model
            path = Path(rm.model.path).expanduser()
            if not path.exists():
                raise RewardFunctionLoadError(f"reward_model.model.path={rm.model.path!r}: no such directory")
            try:
                model = RewardModelScorer(
                    str(path),
                    max_length=rm.max_length,
                    micro_batch_size=rm.micro_batch_size_per_gpu,
                    trust_remote_code=rm.model.trust_remote_code,
                    override_config=rm.model.override_config or None,
                )
            except Exception as e:
                raise RewardFunctionLoadError(
                    f"reward_model.model.path={rm.model.path!r}: cannot load a sequence-classification "
                    f"model: {type(e).__name__}: {e}"
                ) from e
        elif forced:
            if custom.path:
                raise RewardFunctionLoadError(
                    f"a forced built-in ({forced!r}) and custom_reward_function.path={custom.path!r} are "
                    "both set; choose one"
                )
            function = builtin_function(forced)
        elif custom.path:
            function = load_reward_function(custom.path, custom.name, custom.reward_kwargs)
        tokenizer = _policy_tokenizer(cfg.tokenizer_path()) if load_tokenizer else None
        section = cfg.rlmesh.reward
        return cls(
            function,
            model=model,
            timeout_s=timeout_s or section.timeout_s,
            max_concurrency=section.max_concurrency,
            max_batch_size=max_batch_size,
            max_workers=max_workers,
            tokenizer=tokenizer,
            registry=registry,
        )

    # -- what this scorer serves ------------------------------------------------------------------

    def functions(self) -> list[str]:
        """``data_source=function`` for each function served (``*`` when one scores every sample)."""
        if self.model is not None:
            return [f"*=reward_model:{self.model.path}"]
        if self.function is not None:
            return [f"*={self.function.name}"]
        from rlmesh.reward.builtin import DATA_SOURCES

        return [f"{source}={name}" for source, name in DATA_SOURCES.items()] + ["aime*=math_dapo"]

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

    # -- validation -------------------------------------------------------------------------------

    def validate(self, samples: Sequence[reward_pb2.RewardSample]) -> None:
        """Raises ``InvalidRequestError`` naming what is wrong with the batch."""
        if len(samples) == 0:
            raise InvalidRequestError("empty batch: the request has no samples to score")
        if len(samples) > self.max_batch_size:
            raise InvalidRequestError(
                f"batch of {len(samples)} samples is over this service's max_batch_size of "
                f"{self.max_batch_size}; split it"
            )
        for i, sample in enumerate(samples):
            for field in ("prompt_ids", "response_ids"):
                ids = getattr(sample, field)
                if not ids:
                    continue
                low, high = min(ids), max(ids)
                if low < 0:
                    raise InvalidRequestError(
                        f"sample {i} (uid {sample.uid!r}): {field} holds a negative token id {low}"
                    )
                if self.vocab_size is not None and high >= self.vocab_size:
                    raise InvalidRequestError(
                        f"sample {i} (uid {sample.uid!r}): {field} holds token id {high}, not below the "
                        f"vocabulary size {self.vocab_size}"
                    )

    # -- scoring ----------------------------------------------------------------------------------

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
        return reward_pb2.RewardResult(uid=sample.uid, error=_error(code, message, function))

    def _ok(
        self, sample: reward_pb2.RewardSample, function: str, score: float, extra: Mapping[str, float]
    ) -> reward_pb2.RewardResult:
        self.metrics.samples.labels(function).inc()
        self.metrics.scores.labels(function).observe(score)
        return reward_pb2.RewardResult(uid=sample.uid, score=score, extra=extra)

    def _inputs(self, sample: reward_pb2.RewardSample) -> tuple[str, Any]:
        """(solution_str, extra_info); raises ValueError for a sample that cannot be scored."""
        extra_info: Any = {}
        if sample.extra_info_json:
            try:
                extra_info = json.loads(sample.extra_info_json)
            except json.JSONDecodeError as e:
                raise ValueError(f"extra_info_json is not valid JSON: {e}") from None
        solution = sample.response_text
        if not solution and len(sample.response_ids) > 0:
            if self.tokenizer is None:
                raise ValueError(
                    f"response_text is empty but response_ids holds {len(sample.response_ids)} ids, and "
                    "this reward service has no tokenizer to decode them"
                )
            solution = self.tokenizer.decode(list(sample.response_ids), skip_special_tokens=True)
        return solution, extra_info

    def _start(self, fn: RewardFunction, sample: reward_pb2.RewardSample, solution: str, extra_info: Any):
        """Starts one function call: an asyncio future of (value, seconds)."""
        call = functools.partial(fn.call, sample.data_source, solution, sample.ground_truth, extra_info)
        if fn.is_async:
            return asyncio.ensure_future(_guard_async(call()))
        return asyncio.wrap_future(self._pool.submit(_guard_sync, call))

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
                    solution, extra_info = self._inputs(sample)
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
                        f"reward function {fn.name} raised {_describe(e)}",
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
                            f"reward function {fn.name} raised {_describe(e)}",
                        )
                        continue
                    self.metrics.function_seconds.labels(fn.name).observe(seconds)
                    if inspect.isawaitable(value):  # a sync function that returned a coroutine
                        running[asyncio.ensure_future(_guard_async(value))] = (i, fn)
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

    def _convert(self, sample: reward_pb2.RewardSample, function: str, value: Any) -> reward_pb2.RewardResult:
        extra: dict[str, float] = {}
        raw = value
        if isinstance(value, Mapping):
            if "score" not in value:
                keys = ", ".join(map(str, value)) or "none"
                return self._fail(
                    sample,
                    function,
                    ErrorCode.ERROR_CODE_NOT_A_NUMBER,
                    f"reward function {function} returned a dict without a 'score' key (keys: {keys})",
                )
            raw = value["score"]
            for key, item in value.items():
                number = _as_float(item) if key != "score" else None
                if number is not None:
                    extra[str(key)] = number
        score = _as_float(raw)
        if score is None:
            return self._fail(
                sample,
                function,
                ErrorCode.ERROR_CODE_NOT_A_NUMBER,
                f"reward function {function} returned {type(raw).__name__} {_short(raw)}, not a number",
            )
        if not math.isfinite(score):
            return self._fail(
                sample,
                function,
                ErrorCode.ERROR_CODE_NON_FINITE,
                f"reward function {function} returned a non-finite score {score}",
            )
        return self._ok(sample, function, score, extra)

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
                solution, _ = self._inputs(sample)
            except ValueError as e:
                results[i] = self._fail(sample, name, ErrorCode.ERROR_CODE_INVALID_INPUT, str(e))
                continue
            prompt = sample.prompt_text
            if not prompt and len(sample.prompt_ids) > 0 and self.tokenizer is not None:
                prompt = self.tokenizer.decode(list(sample.prompt_ids), skip_special_tokens=True)
            todo.append(i)
            prompts.append(prompt)
            responses.append(solution)
        if todo:
            timeout = self._remaining(deadline)
            model = self.model
            loop = asyncio.get_running_loop()
            future = asyncio.wrap_future(
                self._model_pool.submit(_guard_sync, lambda: model.score(prompts, responses))
            )
            started = time.perf_counter()
            code = ErrorCode.ERROR_CODE_TIMEOUT
            failure = f"the reward model did not finish within {timeout:.3g} s"
            try:
                finished, outcome = await _wait(future, loop.time() + max(timeout, 0.0))
                scores = outcome[0] if finished else None
            except Exception as e:
                finished, scores = False, None
                code, failure = (
                    ErrorCode.ERROR_CODE_FUNCTION_FAILED,
                    f"the reward model raised {_describe(e)}",
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


async def _wait(awaitable: Awaitable[Any], end: float) -> tuple[bool, Any]:
    """Waits for ``awaitable`` until loop time ``end``: (True, value), or (False, None) after cancelling
    it. A sync function already running in a thread cannot be stopped; it finishes unobserved."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(end - asyncio.get_running_loop().time(), 0.0))
        if not done:
            return False, None
        return True, task.result()
    finally:
        if not task.done():
            task.cancel()


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _policy_tokenizer(path: str) -> Any:
    """The policy tokenizer when ``path`` is a local directory with one, else None (no hub lookups)."""
    local = Path(path).expanduser()
    if not local.is_dir() or not any(
        (local / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    try:
        from rlmesh.models.tokenizer import load_tokenizer

        return load_tokenizer(str(local))
    except Exception as e:
        log.warning("could not load the tokenizer at %s (%s); token ids are not checked", local, e)
        return None


__all__ = [
    "InvalidRequestError",
    "RewardFunctionLoadError",
    "RewardMetrics",
    "RewardScorer",
    "load_reward_function",
]
