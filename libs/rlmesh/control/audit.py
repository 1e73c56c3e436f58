"""The audit log of control actions: who changed what, when, from which value to which, kept in
Redis (``<run>:control_audit``, newest first, capped) so it outlives the control plane."""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as aioredis

from rlmesh.queue.keys import RunKeys

AUDIT = "control_audit"


class AuditLog:
    def __init__(self, redis: aioredis.Redis, keys: RunKeys, max_entries: int = 10_000) -> None:
        self.redis = redis
        self.key = keys.scoped(AUDIT)
        self.max_entries = max_entries

    async def record(
        self,
        who: str,
        action: str,
        *,
        target: str = "",
        old: Any = None,
        new: Any = None,
        source: str = "api",
        detail: str = "",
    ) -> dict[str, Any]:
        """Appends one entry and returns it. ``source``: api (a person or script), auto (the
        automatic responses), webhook (an Alertmanager notification)."""
        entry = {
            "time": round(time.time(), 3),
            "who": who,
            "action": action,
            "target": target,
            "old": old,
            "new": new,
            "source": source,
            "detail": detail,
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(self.key, json.dumps(entry, default=str))
            pipe.ltrim(self.key, 0, self.max_entries - 1)
            await pipe.execute()
        return entry

    async def entries(self, limit: int = 100, action: str | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` entries (of ``action`` only, when given), newest first."""
        raw = await self.redis.lrange(self.key, 0, self.max_entries - 1 if action else limit - 1)
        out = []
        for item in raw:
            try:
                entry = json.loads(item)
            except ValueError:
                continue
            if not isinstance(entry, dict):  # whoever can write Redis may put anything there
                continue
            if action is None or entry.get("action") == action:
                out.append(entry)
            if len(out) >= limit:
                break
        return out
