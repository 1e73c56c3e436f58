"""Redis streams as the server sees them: the consumers it holds blocked in a read."""

from __future__ import annotations


async def blocked_reads(redis) -> int:
    """Connections Redis holds blocked in XREADGROUP, from the server's own client list."""
    return sum(1 for c in await redis.client_list() if c["cmd"] == "xreadgroup" and "b" in c["flags"])
