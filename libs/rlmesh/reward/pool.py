"""The guards that run one reward function call on a worker thread or the loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


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
