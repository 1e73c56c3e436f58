"""The trainer's side of weight sync: push named tensors to engines over torch.distributed.

One process group per engine (world size 1 + the engine's ranks, its TP size on SGLang): a
replica that dies mid-push breaks only its own group, so the push fails fast for it — naming
it — and completes for the others; a broadcast's bytes leave the trainer once per receiver either
way on gloo.

A push is SGLang's cycle (docs/sglang.md), the same calls on the embedded engine: pause generation
(running requests retracted: none runs on half-updated weights, and the cache may be flushed),
``/begin_weight_update``, the buckets, ``/end_weight_update``, the new weight version, a flush of
the prefix cache, continue. For each bucket, every engine's update call (names, dtypes, shapes,
load_format) goes out first, then the trainer broadcasts, then the calls' answers are awaited;
an engine that refuses the update before receiving is given up at once, not at the group's
deadline. With ``load_format="flattened_bucket"`` (SGLang's; the default) the bucket is copied
once into one uint8 tensor, shared by all engines, and broadcast as a single collective — or not
copied at all when its tensors already lie back to back in one storage (``bucket.packed_bytes``);
with ``None`` (or to an SGLang older than 0.5.6) each tensor is broadcast on its own, in order.
On CPU the flat buffer (one bucket's bytes) is kept from push to push: see
``rlmesh.weights.bucket``. Every collective has the group's deadline and every HTTP call the
client's: nothing hangs silently.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from rlmesh.engine.client import EngineClient, EngineError
from rlmesh.runtime.net import free_port
from rlmesh.runtime.threads import run_in_daemon_thread
from rlmesh.weights.bucket import FLATTENED_BUCKET, LOAD_FORMATS, flatten_tensors, packed_bytes
from rlmesh.weights.group import destroy_process_group, init_custom_process_group

log = logging.getLogger("rlmesh.weights")

NamedTensors = Iterable[tuple[str, torch.Tensor]]
T = TypeVar("T")


class _PayloadError(Exception):
    """Building a bucket's payload failed (its cause says why); nothing was broadcast."""


class WeightPushError(RuntimeError):
    """A push failed for one or more engines; ``failed`` maps each engine's name to why."""

    def __init__(self, failed: dict[str, str]) -> None:
        self.failed = failed
        super().__init__("weight push failed for " + "; ".join(f"{k}: {v}" for k, v in failed.items()))


@dataclass
class EngineLink:
    client: EngineClient
    ranks: int = 1  # the engine's TP size
    group_name: str = ""
    pg: dist.ProcessGroup | None = None
    healthy: bool = True
    # What this engine is sent: the pusher's load_format, or per tensor for a server too old for it.
    load_format: str | None = None
    # False once the engine said it cannot answer /get_weights_by_name (SGLang's Qwen2 cannot).
    verifiable: bool = True
    # A broadcast on its group may still be pending (abandoned when the engine refused the update
    # before receiving): the group must not be destroyed under it.
    busy: bool = False

    @property
    def name(self) -> str:
        return self.client.name


@dataclass
class PushReport:
    version: str
    seconds: float
    bytes_per_engine: int
    engines: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def buckets(named: NamedTensors, bucket_bytes: int) -> Iterable[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


# How a server says it has no /get_weights_by_name for its model (SGLang's Qwen2: the model class
# lacks the method); any other refusal of a name we pushed is a mismatch.
_UNSUPPORTED = re.compile(r"attribute|not (implemented|supported)", re.IGNORECASE)

# Rows of each checked tensor fetched from an engine: enough to catch a stale or misplaced tensor,
# few enough to keep the JSON small (8 rows of a 4096-wide matrix: 32k numbers).
VERIFY_ROWS = 8


class VerifySample:
    """Picks ``count`` tensors of a push, spread over it by the tensor count of the last push (the
    first ``count`` on a first push), and keeps their first ``VERIFY_ROWS`` rows as float32."""

    def __init__(self, count: int, tensors_last_push: int) -> None:
        self.count = count
        self.stride = max(1, tensors_last_push // count) if count else 0
        self.seen = 0
        self.rows: dict[str, torch.Tensor] = {}

    def offer(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, t in bucket:
            if self.count and len(self.rows) < self.count and self.seen % self.stride == 0:
                self.rows[name] = first_rows(t, VERIFY_ROWS).clone()  # the bucket's storage may go
            self.seen += 1


def first_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """What ``/get_weights_by_name`` answers with ``truncate_size=rows``, as float32 on the CPU."""
    return t.detach()[:rows].to(torch.float32).cpu()


async def differing(client: EngineClient, rows: dict[str, torch.Tensor], truncate_size: int) -> list[str]:
    """The names among ``rows`` (each tensor's ``first_rows``) whose values the engine holds
    otherwise (``same_values``)."""
    differ = []
    for name, ours in rows.items():
        theirs = torch.tensor(await client.get_weights_by_name(name, truncate_size), dtype=torch.float32)
        if not same_values(ours, theirs):
            differ.append(name)
    return differ


def same_values(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Whether an engine's copy equals ours: exactly, or rounded to the half-precision dtype the
    engine may hold (SGLang loads fp32 pushes into bf16 or fp16 parameters)."""
    if ours.shape != theirs.shape:
        return False
    return any(
        torch.equal(ours.to(dtype).to(torch.float32), theirs)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def aligned(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The bucket with every tensor at a byte offset that is a multiple of its element size once
    flattened (SGLang refuses, or fails on, any other): by descending element size, otherwise in
    order — so a bucket of one dtype, the usual case, is unchanged."""
    return sorted(bucket, key=lambda item: -item[1].element_size())


def _wait_all(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()


class WeightPusher:
    def __init__(
        self,
        engines: Sequence[EngineClient],
        *,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        timeout_s: float = 300.0,
        control_timeout_s: float = 30.0,
        bucket_bytes: int = 256 << 20,
        group_prefix: str | None = None,
        load_format: str | None = FLATTENED_BUCKET,
        verify_tensors: int = 0,
    ) -> None:
        """``verify_tensors``: after each push, that many of the pushed tensors (spread over the
        model) are compared with what every engine holds (``/get_weights_by_name``, their first
        ``VERIFY_ROWS`` rows); an engine that differs counts as failed. 0: no check."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {load_format!r}; known: {LOAD_FORMATS}")
        self.load_format = load_format
        self._flat: torch.Tensor | None = None  # the CPU flattened-bucket buffer, reused (see push)
        self.links = [EngineLink(client=e) for e in engines]
        self.backend = backend
        self.master_address = master_address
        self.timeout_s = timeout_s
        # Pause, continue, version and flush answer in well under a second; an engine that takes
        # this long is cut off or wedged, and waiting the push's whole timeout for it would stall
        # the learner (and every other engine) that long.
        self.control_timeout_s = min(control_timeout_s, timeout_s)
        self.bucket_bytes = bucket_bytes
        # Unique per pusher: a restarted trainer must not meet its predecessor's group names.
        self.group_prefix = group_prefix or f"rlmesh_weights_{uuid.uuid4().hex[:8]}"
        self._generation = 0
        self.verify_tensors = verify_tensors
        self._tensors_last_push = 0  # spreads the checked tensors over the model

    def set_engines(
        self, clients: Sequence[EngineClient], ranks: Sequence[int] | None = None
    ) -> list[EngineClient]:
        """Targets exactly these engines (by URL) from now on; ``ranks``: how many ranks each brings
        to its weight group (SGLang: its TP size; default 1). A known healthy engine keeps its
        group; a new one, one that failed before and is listed again, or one whose ranks changed,
        gets a fresh link. Returns the clients no longer used (the caller closes them)."""
        ranks = list(ranks) if ranks is not None else [1] * len(clients)
        by_url = {link.client.url: link for link in self.links}
        links, unused = [], []
        for client, n_ranks in zip(clients, ranks, strict=True):
            link = by_url.pop(client.url, None)
            if link is not None and (not link.healthy or link.ranks != n_ranks):
                self._drop_group(link)
                if link.client is not client:
                    unused.append(link.client)
                link = None
            if link is None:
                link = EngineLink(client=client, ranks=n_ranks)
            elif link.client is not client:
                unused.append(client)
            links.append(link)
        for gone in by_url.values():
            self._drop_group(gone)
            unused.append(gone.client)
        self.links = links
        return unused

    @property
    def healthy_links(self) -> list[EngineLink]:
        return [link for link in self.links if link.healthy]

    async def connect(self, only: set[str] | None = None) -> None:
        """Builds one group per healthy engine that has none; engines that fail are marked unhealthy."""
        failed: dict[str, str] = {}
        todo = [
            link
            for link in self.healthy_links
            if link.pg is None and (only is None or link.client.url in only)
        ]
        await asyncio.gather(*(self._connect(link, failed) for link in todo))
        if failed:
            raise WeightPushError(failed)

    async def _connect(self, link: EngineLink, failed: dict[str, str]) -> None:
        self._generation += 1
        link.group_name = f"{self.group_prefix}_{self._generation}"
        port = free_port(self.master_address)
        world = 1 + link.ranks
        own = run_in_daemon_thread(
            init_custom_process_group,
            self.backend,
            f"tcp://{self.master_address}:{port}",
            world,
            0,
            link.group_name,
            self.timeout_s,
            name="weight-sync",
        )
        try:
            # An engine registered at an address the learner cannot reach would otherwise hold
            # every push up for the whole timeout, once per push.
            if not await link.client.reachable(self.control_timeout_s):
                raise EngineError(f"{link.name}: /health did not answer within {self.control_timeout_s:g} s")
            link.load_format = self.load_format
            if self.load_format == FLATTENED_BUCKET and not await link.client.supports_flattened_bucket():
                link.load_format = None
                log.warning(
                    "engine %s predates load_format=flattened_bucket: pushing it per tensor", link.name
                )
            await link.client.init_weights_update_group(
                self.master_address, port, 1, world, link.group_name, self.backend
            )
            link.pg = await own
        except Exception as e:
            link.healthy = False
            failed[link.name] = f"could not build weight group: {e}"
            log.error("engine %s: weight group failed: %s", link.name, e)
            # Our side of the rendezvous gives up at its deadline; don't wait for it here.
            own.add_done_callback(lambda t: t.exception() is None and destroy_process_group(t.result()))

    async def push(
        self,
        named: NamedTensors,
        version: str | int,
        on_bucket: Callable[[int, int], None] | None = None,
        only: set[str] | None = None,
    ) -> PushReport:
        """Pushes every tensor to every healthy engine (or those whose URL is in ``only``), in
        buckets of about ``bucket_bytes``. Engines that fail are marked unhealthy and listed in the
        report; raises ``WeightPushError`` only if no engine got the weights (an engine whose group
        could not be built counts as failed)."""
        return await self.push_buckets(buckets(named, self.bucket_bytes), version, on_bucket, only)

    async def push_buckets(
        self,
        bucketed: Iterable[Sequence[tuple[str, torch.Tensor]]],
        version: str | int,
        on_bucket: Callable[[int, int], None] | None = None,
        only: set[str] | None = None,
    ) -> PushReport:
        """``push`` of buckets the caller made: each is one update call (and one broadcast with
        flattened_bucket). A bucket is done with — copied or sent — before the next is asked for,
        so its tensors need to stay valid only until then (the learner's ZeRO-3 gathers are freed
        bucket by bucket)."""
        failed = await self.connect_or_mark(only)
        start = time.perf_counter()
        targets = self._targets(only)
        sent = 0
        sample = VerifySample(self.verify_tensors, self._tensors_last_push)

        async def send_buckets() -> None:
            nonlocal sent
            for bucket in bucketed:
                if not bucket:
                    continue
                sample.offer(bucket)  # while the bucket's tensors are valid
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                live = [link for link in targets if link.name not in failed]
                if live:  # with none left, the buckets are still consumed: under ZeRO-3 every rank iterates
                    await self._push_bucket(live, aligned(bucket), failed)
                if on_bucket is not None:
                    on_bucket(len(bucket), sent)  # progress: tensors in this bucket, bytes sent so far

        await self._update_cycle(targets, failed, version, send_buckets)
        self._tensors_last_push = sample.seen
        await self._check(targets, failed, sample.rows)
        return self._report(targets, failed, version, start, sent)

    async def load_from_disk(self, path: str, version: str | int, only: set[str] | None = None) -> PushReport:
        """Every healthy engine (or those whose URL is in ``only``) loads the weights saved at
        ``path`` (an HF directory on storage they share), in the same cycle as a push. Engines that
        fail are marked unhealthy and listed; ``WeightPushError`` only if none loaded them."""
        failed: dict[str, str] = {}
        start = time.perf_counter()
        targets = self._targets(only)

        async def load() -> None:
            await self._each(
                targets,
                failed,
                "update_weights_from_disk",
                lambda c: c.update_weights_from_disk(path, str(version), flush_cache=False),
            )

        await self._update_cycle(targets, failed, version, load)
        return self._report(targets, failed, version, start, 0)

    def _targets(self, only: set[str] | None) -> list[EngineLink]:
        return [link for link in self.healthy_links if only is None or link.client.url in only]

    async def _update_cycle(
        self,
        targets: list[EngineLink],
        failed: dict[str, str],
        version: str | int,
        update: Callable[[], Awaitable[None]],
    ) -> None:
        """SGLang's cycle around ``update`` (docs/sglang.md): running requests retracted, so that
        none generates on half-updated weights and the flush is allowed; the update; the version,
        once all of it landed; the prefix cache, computed with the old weights, dropped; go on. An
        engine that failed stays paused: it may hold half-written weights (the embedded engine holds
        them anyway); the next update to it, a full one, lets it go on."""
        quick = self.control_timeout_s
        await self._each(targets, failed, "pause_generation", lambda c: c.pause_generation(), quick)
        await self._each(targets, failed, "begin_weight_update", lambda c: c.begin_weight_update())
        await update()
        await self._each(targets, failed, "end_weight_update", lambda c: c.end_weight_update())
        # The version and the flush are independent of each other; both must precede continue.
        await asyncio.gather(
            self._each(
                targets,
                failed,
                "update_weight_version",
                lambda c: c.update_weight_version(str(version)),
                quick,
            ),
            self._each(targets, failed, "flush_cache", lambda c: c.flush_cache(), quick),
        )
        await self._each(targets, failed, "continue_generation", lambda c: c.continue_generation(), quick)

    async def _check(
        self, targets: list[EngineLink], failed: dict[str, str], rows: dict[str, torch.Tensor]
    ) -> None:
        """Compares the sampled rows with each engine's; an engine that differs fails."""

        async def one(link: EngineLink) -> None:
            try:
                differ = await differing(link.client, rows, VERIFY_ROWS)
            except EngineError as e:
                if not (e.status == 404 or (e.status == 400 and _UNSUPPORTED.search(str(e)))):
                    raise
                link.verifiable = False
                log.warning(
                    "engine %s cannot answer /get_weights_by_name; pushes to it are not checked: %s",
                    link.name,
                    e,
                )
                return
            if differ:
                failed[link.name] = f"after the push it holds other values for {', '.join(differ)}"
                log.error("engine %s: weights differ from the pushed ones: %s", link.name, differ)

        async def guarded(link: EngineLink) -> None:
            try:
                await one(link)
            except (EngineError, OSError) as e:
                failed[link.name] = f"checking the pushed weights: {e}"

        if rows:
            await asyncio.gather(
                *(guarded(link) for link in targets if link.name not in failed and link.verifiable)
            )

    def _report(
        self, targets: list[EngineLink], failed: dict[str, str], version: str | int, start: float, sent: int
    ) -> PushReport:
        for link in targets:
            if link.name in failed:
                link.healthy = False
                self._drop_group(link)
        report = PushReport(
            version=str(version),
            seconds=time.perf_counter() - start,
            bytes_per_engine=sent,
            engines=[link.name for link in targets if link.name not in failed],
            failed=failed,
        )
        if failed and not report.engines:
            raise WeightPushError(failed)
        return report

    async def connect_or_mark(self, only: set[str] | None = None) -> dict[str, str]:
        """``connect``, returning the engines whose group failed (they are marked unhealthy)."""
        try:
            await self.connect(only)
        except WeightPushError as e:
            log.error("%s", e)
            return dict(e.failed)
        return {}

    async def _push_bucket(
        self, live: list[EngineLink], bucket: list[tuple[str, torch.Tensor]], failed: dict[str, str]
    ) -> None:
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
            works, errors = await asyncio.to_thread(self._start_broadcasts, live, tensors)
        except _PayloadError as e:
            # The engines now wait for a broadcast that will not come: their groups are spent.
            self._flat = None
            for link in live:
                calls[link.name].cancel()
                link.healthy = False
                self._drop_group(link)
            raise (e.__cause__ or e) from None
        except BaseException:
            # Cancelled: the sending thread may still hold the buffer; don't reuse it.
            self._flat = None
            for call in calls.values():
                call.cancel()
            raise
        await asyncio.gather(
            *(
                self._settle(link, calls[link.name], works.get(link.name), errors.get(link.name), failed)
                for link in live
            )
        )
        if any(link.name in failed for link in live):
            self._flat = None  # a transport may still hold the buffer

    def _start_broadcasts(
        self, live: list[EngineLink], tensors: list[torch.Tensor]
    ) -> tuple[dict[str, list[dist.Work]], dict[str, BaseException]]:
        """Builds the payloads and starts every engine's broadcast, in one worker thread: the bytes
        start to flow as soon as they are ready, with no hop back through the event loop (at tens
        of MB that hop costs as much as the copy). Every engine's group has its own gloo worker, so
        the engines receive concurrently. Returns the pending broadcasts and those that failed to
        start, by engine."""
        try:
            payloads = {fmt: self._payload(tensors, fmt) for fmt in {link.load_format for link in live}}
        except BaseException as e:
            raise _PayloadError() from e
        works: dict[str, list[dist.Work]] = {}
        errors: dict[str, BaseException] = {}
        for link in live:
            assert link.pg is not None
            try:
                # All queued at once (as SGLang receives them), then awaited.
                works[link.name] = [
                    dist.broadcast(t, src=0, group=link.pg, async_op=True) for t in payloads[link.load_format]
                ]
            except (RuntimeError, OSError) as e:
                errors[link.name] = e
        return works, errors

    async def _settle(
        self,
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

    def _payload(self, tensors: list[torch.Tensor], load_format: str | None) -> list[torch.Tensor]:
        """What to broadcast, in order, shared by every engine of ``load_format``: one flat uint8
        tensor (flattened_bucket) or the tensors themselves."""
        device = "cpu" if self.backend == "gloo" else None
        if load_format == FLATTENED_BUCKET:
            packed = packed_bytes(tensors, device)
            if packed is not None:
                return [packed]  # already laid out as the bucket: no copy
            # One copy into one buffer. On CPU the buffer is kept for the next bucket and push
            # (its first touch page-faults, which costs more than the copy); on GPU torch's
            # caching allocator already reuses memory.
            flat = flatten_tensors(tensors, device, self._flat)
            if flat.device.type == "cpu" and (self._flat is None or flat.numel() > self._flat.numel()):
                self._flat = flat
            return [flat]
        # .contiguous() and .to() return the tensor itself when it already is: no copy then.
        return [t.contiguous() if device is None else t.contiguous().to(device) for t in tensors]

    async def _each(
        self,
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

    def _drop_group(self, link: EngineLink) -> None:
        if link.pg is not None and link.busy:
            # Destroying a group under a pending collective can abort the process: let it time out.
            log.warning("engine %s: weight group %s left to its deadline", link.name, link.group_name)
        elif link.pg is not None:
            destroy_process_group(link.pg)
        link.pg = None

    async def verify(self, sample: dict[str, torch.Tensor], truncate_size: int = 100) -> dict[str, list[str]]:
        """Compares a sample of tensors with what each healthy engine holds (``/get_weights_by_name``).
        Returns the names that differ, by engine (empty lists when everything matches)."""
        rows = {name: first_rows(t, truncate_size) for name, t in sample.items()}
        return {link.name: await differing(link.client, rows, truncate_size) for link in self.healthy_links}

    async def close(self) -> None:
        self._flat = None
        for link in self.links:
            if link.pg is not None and link.healthy:
                try:
                    await link.client.destroy_weights_update_group(link.group_name)
                except EngineError as e:
                    log.warning("%s", e)
            self._drop_group(link)
