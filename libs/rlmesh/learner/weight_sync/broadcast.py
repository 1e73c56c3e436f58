"""One bucket of a push: every engine's update call, the broadcasts on their groups, the answers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlmesh.engine.client import EngineError
from rlmesh.learner.weight_sync.links import EngineLink, drop_group
from rlmesh.learner.weight_sync.payload import Packer
from rlmesh.runtime.threads import run_in_daemon_thread

log = logging.getLogger("rlmesh.weights")


class _PayloadError(Exception):
    """Building a bucket's payload failed (its cause says why); nothing was broadcast."""


async def push_bucket(
    live: list[EngineLink], bucket: list[tuple[str, torch.Tensor]], failed: dict[str, str], packer: Packer
) -> None:
    """Sends ``bucket`` to every engine of ``live``; an engine it fails for is listed in ``failed``.
    Raises when the payload cannot be built: every engine's group is then spent."""
    tensors = [t.detach() for _, t in bucket]
    names = [n for n, _ in bucket]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    shapes = [list(t.shape) for t in tensors]
    # The engine must be inside its receive before our broadcast can complete: each engine's
    # call goes out first — it gets there while we prepare the payload — then we broadcast,
    # then take its answer. No weight_version here: it is set once every bucket landed.
    calls = {
        link.name: asyncio.create_task(
            link.client.update_weights_from_distributed(
                names, dtypes, shapes, link.group_name, None, load_format=link.load_format
            )
        )
        for link in live
    }
    try:
        works, errors = await asyncio.to_thread(_start_broadcasts, live, tensors, packer)
    except _PayloadError as e:
        # The engines now wait for a broadcast that will not come: their groups are spent.
        packer.forget()
        for link in live:
            calls[link.name].cancel()
            link.healthy = False
            drop_group(link)
        raise (e.__cause__ or e) from None
    except BaseException:
        # Cancelled: the sending thread may still hold the buffer; don't reuse it.
        packer.forget()
        for call in calls.values():
            call.cancel()
        raise
    await asyncio.gather(
        *(
            _settle(link, calls[link.name], works.get(link.name), errors.get(link.name), failed)
            for link in live
        )
    )
    if any(link.name in failed for link in live):
        packer.forget()  # a transport may still hold the buffer


def _start_broadcasts(
    live: list[EngineLink], tensors: list[torch.Tensor], packer: Packer
) -> tuple[dict[str, list[dist.Work]], dict[str, BaseException]]:
    """Builds the payloads and starts every engine's broadcast, in one worker thread: the bytes
    start to flow as soon as they are ready, with no hop back through the event loop (at tens
    of MB that hop costs as much as the copy). Every engine's group has its own gloo worker, so
    the engines receive concurrently. Returns the pending broadcasts and those that failed to
    start, by engine."""
    try:
        payloads = {
            (fmt, backend): packer.payload(tensors, fmt, backend)
            for fmt, backend in {(link.load_format, link.backend) for link in live}
        }
    except BaseException as e:
        raise _PayloadError() from e
    works: dict[str, list[dist.Work]] = {}
    errors: dict[str, BaseException] = {}
    for link in live:
        assert link.pg is not None
        try:
            # All queued at once (as SGLang receives them), then awaited.
            works[link.name] = [
                dist.broadcast(t, src=0, group=link.pg, async_op=True)
                for t in payloads[link.load_format, link.backend]
            ]
        except (RuntimeError, OSError) as e:
            errors[link.name] = e
    return works, errors


async def _settle(
    link: EngineLink,
    call: asyncio.Task[str],
    works: list[dist.Work] | None,
    error: BaseException | None,
    failed: dict[str, str],
) -> None:
    """Waits for one engine's broadcast and answer. An engine that answers with an error before
    our broadcast to it completed refused the update (or failed receiving): its broadcast is
    abandoned — not waited out to the group's deadline — and its group left alone."""
    if error is None and works is not None:
        sent = run_in_daemon_thread(_wait_all, works, name="weight-sync")
        await asyncio.wait({sent, call}, return_when=asyncio.FIRST_COMPLETED)
        if not sent.done() and call.exception() is not None:
            link.busy = True
            error = call.exception()
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # ends unawaited
        else:
            try:
                await sent
                await call
            except (EngineError, RuntimeError, OSError) as e:
                error = e
    if error is not None:
        call.cancel()
        failed[link.name] = f"{type(error).__name__}: {error}"
        log.error("engine %s: weight push failed: %s", link.name, error)


def _wait_all(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()
