"""Shared test helpers (plain functions, no fixtures with hidden state)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a reaped-later corpse counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Polls ``condition`` until true; fails the test naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


async def eventually(read: Callable, expected: object, what: str, timeout_s: float = 30) -> None:
    """Polls ``await read()`` until it returns ``expected``; fails naming ``what`` and the last value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (value := await read()) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"waiting for {what}: still {value!r}"
        await asyncio.sleep(0.02)


async def blocked_reads(redis) -> int:
    """Connections Redis holds blocked in XREADGROUP, from the server's own client list."""
    return sum(1 for c in await redis.client_list() if c["cmd"] == "xreadgroup" and "b" in c["flags"])


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def prompt_items(count: int) -> list:
    """``count`` one-token prompts (index i holds token i + 1), as a dataset hands them out."""
    from rlmesh.data import PromptItem

    return [
        PromptItem(
            index=i,
            prompt_ids=[i + 1],
            prompt_text=f"p{i}",
            ground_truth=str(i),
            data_source="arithmetic",
            ability="math",
            row=i,
            file="mem",
            raw_prompt=f"p{i}",
        )
        for i in range(count)
    ]
