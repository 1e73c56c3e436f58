"""Thread helpers: blocking calls run on daemon threads, so that a call that never returns cannot
hold up the process's exit."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_daemon_thread(
    fn: Callable[..., T], *args: object, name: str = "blocking-call"
) -> asyncio.Future[T]:
    """Awaitable ``fn(*args)`` in a daemon thread. For calls that cannot be cancelled (a rendezvous
    whose peer never came waits out its deadline): in asyncio's executor they would hold up the
    process's exit, since its threads are joined."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting task
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


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
