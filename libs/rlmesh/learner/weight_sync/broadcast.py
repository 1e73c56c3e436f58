"""One bucket of a push: every engine's update call, the broadcasts on their groups, the answers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlmesh.engine.client import EngineError
from rlmesh.learner.weight_sync.links import EngineLink, WeightGroup, drop_group
from rlmesh.learner.weight_sync.payload import Packer
from rlmesh.runtime.threads import run_in_daemon_thread

log = logging.getLogger("rlmesh.weights")


class _PayloadError(Exception):
    """Building a bucket's payload failed (its cause says why); nothing was broadcast."""


async def push_bucket(
    live: list[EngineLink], bucket: list[tuple[str, torch.Tensor]], failed: dict[str, str], packer: Packer
) -> None:
    """Sends ``bucket`` to every engine of ``live`` (whole groups: every member of each group
    there); an engine it fails for is listed in ``failed``, and so is every other member of its
    group, which the failure spent. Raises when the payload cannot be built: every engine's group
    is then spent."""
    tensors = [t.detach() for _, t in bucket]
    names = [n for n, _ in bucket]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    shapes = [list(t.shape) for t in tensors]
    groups = groups_of(live)
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
        works, errors = await asyncio.to_thread(_start_broadcasts, groups, tensors, packer)
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
            _settle(
                group,
                {m.name: calls[m.name] for m in group.members},
                works.get(group.name),
                errors.get(group.name),
                failed,
            )
            for group in groups
        )
    )
    if any(link.name in failed for link in live):
        packer.forget()  # a transport may still hold the buffer


def groups_of(links: list[EngineLink]) -> list[WeightGroup]:
    """The distinct groups of ``links``, in order; each must be there whole."""
    groups: dict[int, WeightGroup] = {}
    for link in links:
        assert link.group is not None and link.group.pg is not None, f"{link.name} has no weight group"
        groups.setdefault(id(link.group), link.group)
    names = {link.name for link in links}
    for group in groups.values():
        assert all(m.name in names for m in group.members), f"weight group {group.name} is not whole"
    return list(groups.values())


def _start_broadcasts(
    groups: list[WeightGroup], tensors: list[torch.Tensor], packer: Packer
) -> tuple[dict[str, list[dist.Work]], dict[str, BaseException]]:
    """Builds the payloads and starts every group's broadcast, in one worker thread: the bytes
    start to flow as soon as they are ready, with no hop back through the event loop (at tens
    of MB that hop costs as much as the copy). Every group has its own gloo worker, so the groups
    receive concurrently. Returns the pending broadcasts and those that failed to start, by group."""
    # Members of one group share its broadcasts: build_group settled one format for them all.
    formats = {group.name: group.members[0].load_format for group in groups}
    try:
        payloads = {
            (fmt, backend): packer.payload(tensors, fmt, backend)
            for fmt, backend in {(formats[group.name], group.backend) for group in groups}
        }
    except BaseException as e:
        raise _PayloadError() from e
    works: dict[str, list[dist.Work]] = {}
    errors: dict[str, BaseException] = {}
    for group in groups:
        assert group.pg is not None
        try:
            # All queued at once (as SGLang receives them), then awaited.
            works[group.name] = [
                dist.broadcast(t, src=0, group=group.pg, async_op=True)
                for t in payloads[formats[group.name], group.backend]
            ]
        except (RuntimeError, OSError) as e:
            errors[group.name] = e
    return works, errors


async def _settle(
    group: WeightGroup,
    calls: dict[str, asyncio.Task[str]],
    works: list[dist.Work] | None,
    error: BaseException | None,
    failed: dict[str, str],
) -> None:
    """Waits for one group's broadcast and its members' answers. A member that answers with an
    error before our broadcast completed refused the update (or failed receiving): the broadcast
    is abandoned — not waited out to the group's deadline — and the group left alone. Whatever
    fails one member fails the group: every member is listed."""
    why: dict[str, str] = {}
    if error is None and works is not None:
        sent = run_in_daemon_thread(_wait_all, works, name="weight-sync")
        name_of = {call: name for name, call in calls.items()}
        waiting: set[asyncio.Future] = {sent, *calls.values()}
        while not sent.done():
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            refused = {name_of[c]: c.exception() for c in done if c is not sent and c.exception() is not None}
            if refused and not sent.done():
                group.busy = True
                why.update({name: f"{type(e).__name__}: {e}" for name, e in refused.items()})
                sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # ends unawaited
                break
        if not group.busy:
            try:
                await sent
            except (RuntimeError, OSError) as e:
                error = e
        if not group.busy and error is None:
            for name, call in calls.items():
                try:
                    await call
                except (EngineError, RuntimeError, OSError) as e:
                    why[name] = f"{type(e).__name__}: {e}"
    if error is not None:
        for name in calls:
            why.setdefault(name, f"{type(error).__name__}: {error}")
    if not why:
        return
    for name, call in calls.items():
        call.cancel()
        failed[name] = why.get(name) or f"another engine of its weight group failed: {', '.join(why)}"
        log.error("engine %s: weight push failed: %s", name, failed[name])


def _wait_all(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()
