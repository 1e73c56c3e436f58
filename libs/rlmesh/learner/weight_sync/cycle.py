"""SGLang's cycle around a weight update (docs/sglang.md), sent to every engine of a push at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from rlmesh.engine.client import EngineClient, EngineError
from rlmesh.learner.weight_sync.links import EngineLink

log = logging.getLogger("rlmesh.weights")


async def update_cycle(
    targets: list[EngineLink],
    failed: dict[str, str],
    version: str | int,
    update: Callable[[], Awaitable[None]],
    control_timeout_s: float,
    pause_mode: str = "retract",
) -> None:
    """SGLang's cycle around ``update``: generation paused, so that no token is sampled from
    half-updated weights; the update; the version, once all of it landed; go on.

    ``pause_mode`` "retract" puts running requests back in the queue and drops the prefix cache,
    computed with the old weights (the requests recompute theirs after); "in_place" keeps them and
    their KV cache where they are: they go on with the new weights from the next token, and there
    is no flush (SGLang refuses one while requests run). An engine that failed stays paused: it may
    hold half-written weights (the embedded engine holds them anyway); the next update to it, a full
    one, lets it go on. Pause, version, flush and continue get ``control_timeout_s``, the update
    calls their client's timeout."""
    quick = control_timeout_s
    await each(targets, failed, "pause_generation", lambda c: c.pause_generation(pause_mode), quick)
    await each(targets, failed, "begin_weight_update", lambda c: c.begin_weight_update())
    await update()
    await each(targets, failed, "end_weight_update", lambda c: c.end_weight_update())
    # The version and the flush are independent of each other; both must precede continue.
    calls = [
        each(targets, failed, "update_weight_version", lambda c: c.update_weight_version(str(version)), quick)
    ]
    if pause_mode != "in_place":
        calls.append(each(targets, failed, "flush_cache", lambda c: c.flush_cache(), quick))
    await asyncio.gather(*calls)
    await each(targets, failed, "continue_generation", lambda c: c.continue_generation(), quick)


async def each(
    links: list[EngineLink],
    failed: dict[str, str],
    what: str,
    call: Callable[[EngineClient], Awaitable[object]],
    deadline_s: float | None = None,
) -> None:
    """``call`` on every engine not failed yet, concurrently; an engine whose call fails, or
    does not answer within ``deadline_s`` (default: its client's timeout), fails."""

    async def one(link: EngineLink) -> None:
        try:
            await asyncio.wait_for(call(link.client), deadline_s)
        except TimeoutError:
            failed[link.name] = f"{what}: no answer within {deadline_s:g} s"
            log.error("engine %s: %s: no answer within %g s", link.name, what, deadline_s)
        except (EngineError, OSError) as e:
            failed[link.name] = f"{what}: {e}"
            log.error("engine %s: %s failed: %s", link.name, what, e)

    await asyncio.gather(*(one(link) for link in links if link.name not in failed))
