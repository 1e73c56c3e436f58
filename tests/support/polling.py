"""Waiting for a condition with a deadline: ``wait_until`` (blocking) and ``eventually`` (async)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.02) -> None:
    """Polls ``condition`` every ``every_s`` until true; fails the test naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


async def eventually(read: Callable, expected: object, what: str, timeout_s: float = 30) -> None:
    """Polls ``await read()`` until it returns ``expected``; fails naming ``what`` and the last value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (value := await read()) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"waiting for {what}: still {value!r}"
        await asyncio.sleep(0.02)
