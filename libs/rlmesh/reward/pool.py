"""The worker pool for sync reward functions, and the guards that run one call on it or the loop."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any


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


class Aborted(Exception):
    """A reward function raised SystemExit/KeyboardInterrupt: reported like any other failure, it
    must never stop the service (asyncio re-raises those out of the event loop)."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


def guard_sync(call: Callable[[], Any]) -> tuple[Any, float]:
    """Runs a sync reward function on a pool thread: (value, seconds)."""
    started = time.perf_counter()
    try:
        return call(), time.perf_counter() - started
    except Exception:
        raise
    except BaseException as e:
        raise Aborted(e) from e


async def guard_async(awaitable: Awaitable[Any]) -> tuple[Any, float]:
    """Awaits an async reward function on the loop: (value, seconds)."""
    started = time.perf_counter()
    try:
        return await awaitable, time.perf_counter() - started
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as e:
        raise Aborted(e) from e


def describe(exc: BaseException) -> str:
    """``Type: message`` of what a reward function raised."""
    original = exc.original if isinstance(exc, Aborted) else exc
    return f"{type(original).__name__}: {original}"


async def wait_until(awaitable: Awaitable[Any], end: float) -> tuple[bool, Any]:
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
