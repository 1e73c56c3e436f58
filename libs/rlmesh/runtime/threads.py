"""Thread helpers: blocking calls awaited from asyncio without holding up the process's exit."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

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
