"""What the learner publishes about its run for the control plane on any host: each step's metrics
on a capped stream (``<run>:metrics``) and the config as it resolved it (``<run>:config``).
docs/control.md"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from rlmesh.queue.keys import RunKeys

METRICS = "metrics"
CONFIG = "config"
# One XRANGE call reads this many entries at most: a long history is read in pages.
PAGE = 1000


def metrics_key(keys: RunKeys) -> str:
    return keys.scoped(METRICS)


def config_key(keys: RunKeys) -> str:
    return keys.scoped(CONFIG)


async def publish_step_metrics(
    redis: aioredis.Redis, keys: RunKeys, step: int, metrics: Mapping[str, float], maxlen: int
) -> None:
    """Appends one step's finite metrics; the stream keeps about the last ``maxlen`` entries."""
    clean = {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))
    }
    fields = {"step": str(int(step)), "time": f"{time.time():.3f}", "metrics": json.dumps(clean)}
    await redis.xadd(metrics_key(keys), fields, maxlen=maxlen, approximate=True)


def _row(entry_id: bytes, fields: dict[bytes, bytes]) -> dict[str, Any] | None:
    try:
        metrics = json.loads(fields[b"metrics"])
        return {
            "step": int(fields[b"step"]),
            "time": float(fields[b"time"]),
            "id": entry_id.decode(),
            "metrics": {str(k): float(v) for k, v in metrics.items()},
        }
    except (KeyError, ValueError, TypeError, AttributeError):
        return None  # written by something else: skipped, never an error for the reader


async def read_step_metrics(
    redis: aioredis.Redis, keys: RunKeys, *, after_id: str = "-", limit: int | None = None
) -> list[dict[str, Any]]:
    """Rows ``{step, time, id, metrics}`` oldest first, from after stream entry ``after_id`` (``-``:
    the start); a step written twice (a resumed run redoes it) appears twice, the later row last."""
    rows: list[dict[str, Any]] = []
    start = after_id if after_id == "-" else f"({after_id}"
    while limit is None or len(rows) < limit:
        page = await redis.xrange(metrics_key(keys), min=start, max="+", count=PAGE)
        for entry_id, fields in page:
            row = _row(entry_id, fields)
            if row is not None:
                rows.append(row)
        if len(page) < PAGE:
            break
        start = f"({page[-1][0].decode()}"
    return rows if limit is None else rows[:limit]


async def read_recent_metrics(redis: aioredis.Redis, keys: RunKeys, count: int) -> list[dict[str, Any]]:
    """The newest ``count`` rows, oldest first."""
    page = await redis.xrevrange(metrics_key(keys), count=count)
    rows = [_row(entry_id, fields) for entry_id, fields in reversed(page)]
    return [r for r in rows if r is not None]


def latest_per_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the last written (a redone step's own), by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


async def publish_config(redis: aioredis.Redis, keys: RunKeys, config_yaml: str) -> None:
    """The config the learner runs with, secrets already removed by the caller."""
    await redis.set(config_key(keys), config_yaml)


async def read_config(redis: aioredis.Redis, keys: RunKeys) -> str | None:
    value = await redis.get(config_key(keys))
    # Shown, never parsed here: bytes that are not text must not fail the reader.
    return None if value is None else value.decode(errors="replace")
