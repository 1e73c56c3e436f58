"""The trainer's side of weight sync: push named tensors to engines over torch.distributed, in
SGLang's update cycle (docs/sglang.md); its helpers are the other modules of ``weight_sync``."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from rlmesh.config import RLMeshConfig
from rlmesh.engine.client import EngineClient
from rlmesh.learner.weight_sync.broadcast import push_bucket
from rlmesh.learner.weight_sync.cycle import each, update_cycle
from rlmesh.learner.weight_sync.links import (
    AUTO_FORMAT,
    EngineLink,
    WeightGroup,
    build_group,
    close_link,
    drop_group,
    partition,
    relink,
    retire,
)
from rlmesh.learner.weight_sync.payload import NamedTensors, Packer, aligned, buckets
from rlmesh.learner.weight_sync.verify import (
    VERIFY_ROWS,
    VerifySample,
    check_engines,
    differing,
    first_rows,
    same_values,
)
from rlmesh.runtime.net import advertised_host
from rlmesh.weights.bucket import FLATTENED_BUCKET, LOAD_FORMATS

__all__ = [
    "VERIFY_ROWS",
    "EngineLink",
    "NamedTensors",
    "PushReport",
    "VerifySample",
    "WeightPushError",
    "WeightPusher",
    "aligned",
    "buckets",
    "differing",
    "first_rows",
    "same_values",
    "weight_master_address",
]

log = logging.getLogger("rlmesh.weights")

Bucket = Sequence[tuple[str, torch.Tensor]]


def weight_master_address(cfg: RLMeshConfig) -> str:
    """The host engines dial to join the learner's weight groups: ``rlmesh.weight_sync.master_address``,
    else the learner's advertised host (docs/design.md#addresses)."""
    if cfg.rlmesh.weight_sync.master_address:
        return cfg.rlmesh.weight_sync.master_address
    learner = cfg.rlmesh.learner
    return advertised_host(
        learner.host,
        advertise=learner.advertise_address,
        key="rlmesh.learner.advertise_address",
        redis_url=cfg.rlmesh.redis_url,
    )


def whole_groups(targets: list[EngineLink], failed: dict[str, str]) -> list[EngineLink]:
    """The engines of ``targets`` whose weight group has no failed member; the other members of
    a group with one are listed in ``failed`` too (a broadcast needs every member of its group)."""
    live = []
    for link in targets:
        spoilt = [m.name for m in link.members if m.name in failed]
        if not spoilt:
            live.append(link)
        elif link.name not in failed:
            failed[link.name] = f"another engine of its weight group failed: {', '.join(spoilt)}"
            log.error("engine %s: left out of the push: %s", link.name, failed[link.name])
    return live


async def each_bucket(bucketed: Iterable[Bucket] | AsyncIterable[Bucket]) -> AsyncIterator[Bucket]:
    """``bucketed``'s buckets, whether the caller made them as a list, a generator or an async one."""
    if isinstance(bucketed, AsyncIterable):
        async for bucket in bucketed:
            yield bucket
    else:
        for bucket in bucketed:
            yield bucket


class WeightPushError(RuntimeError):
    """A push failed for one or more engines; ``failed`` maps each engine's name to why."""

    def __init__(self, failed: dict[str, str]) -> None:
        self.failed = failed
        super().__init__("weight push failed for " + "; ".join(f"{k}: {v}" for k, v in failed.items()))


@dataclass
class PushReport:
    version: str
    seconds: float
    bytes_per_engine: int
    engines: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    # Engines that took the push but cannot read weights back, so it was not checked on them.
    unchecked: list[str] = field(default_factory=list)
    groups: int = 0  # the weight groups of the engines that took it (transport=disk: none)


class WeightPusher:
    """Pushes named tensors to inference engines over weight groups (``EngineLink``,
    ``WeightGroup``): one per engine, or shared by up to ``group_size`` engines.

    Every collective has the group's deadline and every HTTP call its client's: nothing hangs
    silently. An engine that fails is marked unhealthy, and gets a fresh link when listed again;
    a failure that spends a shared group fails each of its members for that push.
    """

    def __init__(
        self,
        engines: Sequence[EngineClient],
        *,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 300.0,
        control_timeout_s: float = 30.0,
        bucket_bytes: int = 256 << 20,
        group_prefix: str | None = None,
        load_format: str | None = FLATTENED_BUCKET,
        verify_tensors: int = 0,
        pause_mode: str = "retract",
        group_size: int = 1,
    ) -> None:
        """``master_port``: each engine's group rendezvous takes the lowest free port from it
        up (0: any free port). ``verify_tensors``: after each push, that many of the pushed tensors (spread over the
        model) are compared with what every engine holds (``/get_weights_by_name``, their first
        ``VERIFY_ROWS`` rows); an engine that differs counts as failed. 0: no check.
        ``group_size``: engines sharing one weight group, so one broadcast reaches them all (gloo
        relays it along a tree, NCCL along a ring: the trainer sends about one copy per group, not
        one per engine); one failing mid-push costs every member of its group that push.
        ``load_format``: ``flattened_bucket``, None (per tensor) or ``auto`` (per tensor to a gloo
        group of several engines, whose tree pipelines only successive broadcasts; else flattened)."""
        if load_format not in (*LOAD_FORMATS, AUTO_FORMAT):
            raise ValueError(f"unknown load_format {load_format!r}; known: {(*LOAD_FORMATS, AUTO_FORMAT)}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        self.load_format = load_format
        self.pause_mode = pause_mode
        self._packer = Packer()
        self.links = [EngineLink(client=e, backend=backend) for e in engines]
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = timeout_s
        # Pause, continue, version and flush answer in well under a second; an engine that takes
        # this long is cut off or wedged, and waiting the push's whole timeout for it would stall
        # the learner (and every other engine) that long.
        self.control_timeout_s = min(control_timeout_s, timeout_s)
        self.bucket_bytes = bucket_bytes
        # Unique per pusher: a restarted trainer must not meet its predecessor's group names.
        self.group_prefix = group_prefix or f"rlmesh_weights_{uuid.uuid4().hex[:8]}"
        self._generation = 0
        self._groups: list[WeightGroup] = []  # built and not yet retired
        self.verify_tensors = verify_tensors
        self._tensors_last_push = 0  # spreads the checked tensors over the model

    def set_engines(
        self,
        clients: Sequence[EngineClient],
        ranks: Sequence[int] | None = None,
        backends: Sequence[str] | None = None,
    ) -> list[EngineClient]:
        """Targets exactly these engines (by URL) from now on; ``ranks``: how many ranks each brings
        to its weight group (SGLang: its TP size; default 1); ``backends``: each group's
        (``weight_sync_backend``; default the pusher's). A known healthy engine keeps its group; a
        new one, one that failed before and is listed again, or one whose ranks or backend changed,
        gets a fresh link. Returns the clients no longer used (the caller closes them)."""
        ranks = list(ranks) if ranks is not None else [1] * len(clients)
        backends = list(backends) if backends is not None else [self.backend] * len(clients)
        self.links, unused = relink(self.links, clients, ranks, backends)
        return unused

    @property
    def healthy_links(self) -> list[EngineLink]:
        return [link for link in self.links if link.healthy]

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
        bucketed: Iterable[Bucket] | AsyncIterable[Bucket],
        version: str | int,
        on_bucket: Callable[[int, int], None] | None = None,
        only: set[str] | None = None,
    ) -> PushReport:
        """``push`` of buckets the caller made: each is one update call (and one broadcast with
        flattened_bucket). A bucket is done with — copied or sent — before the next is asked for,
        so its tensors need to stay valid only until then (the learner's ZeRO-3 gathers are freed
        bucket by bucket). An async iterable is awaited between buckets: the learner gathers each
        on its trainer thread, with the event loop free meanwhile."""
        failed = await self.connect_or_mark(only)
        start = time.perf_counter()
        targets = self._targets(only)
        sent = 0
        sample = VerifySample(self.verify_tensors, self._tensors_last_push)

        async def send_buckets() -> None:
            nonlocal sent
            async for bucket in each_bucket(bucketed):
                if not bucket:
                    continue
                sample.offer(bucket)  # while the bucket's tensors are valid
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                live = whole_groups(targets, failed)
                if live:  # with none left, the buckets are still consumed: under ZeRO-3 every rank iterates
                    await push_bucket(live, aligned(bucket), failed, self._packer)
                if on_bucket is not None:
                    on_bucket(len(bucket), sent)  # progress: tensors in this bucket, bytes sent so far

        await update_cycle(targets, failed, version, send_buckets, self.control_timeout_s, self.pause_mode)
        self._tensors_last_push = sample.seen
        await check_engines(targets, failed, sample.rows)
        return self._report(targets, failed, version, start, sent)

    async def load_from_disk(self, path: str, version: str | int, only: set[str] | None = None) -> PushReport:
        """Every healthy engine (or those whose URL is in ``only``) loads the weights saved at
        ``path`` (an HF directory on storage they share), in the same cycle as a push. Engines that
        fail are marked unhealthy and listed; ``WeightPushError`` only if none loaded them."""
        failed: dict[str, str] = {}
        start = time.perf_counter()
        targets = self._targets(only)

        async def load() -> None:
            await each(
                targets,
                failed,
                "update_weights_from_disk",
                lambda c: c.update_weights_from_disk(path, str(version), flush_cache=False),
            )

        await update_cycle(targets, failed, version, load, self.control_timeout_s, self.pause_mode)
        return self._report(targets, failed, version, start, 0)

    async def connect_or_mark(self, only: set[str] | None = None) -> dict[str, str]:
        """``connect``, returning the engines whose group failed (they are marked unhealthy)."""
        try:
            await self.connect(only)
        except WeightPushError as e:
            log.error("%s", e)
            return dict(e.failed)
        return {}

    async def connect(self, only: set[str] | None = None) -> None:
        """Builds groups of up to ``group_size`` for the healthy engines that have none; engines
        that fail are marked unhealthy. On a push to all, fragments (groups left under half the
        size by failures and engines gone) are merged, so that churn does not leave many small
        groups, each costing its own copies."""
        if only is None:
            self._merge_fragments()
        await self._retire_dropped()
        failed: dict[str, str] = {}
        todo = [
            link
            for link in self.healthy_links
            if link.pg is None and (only is None or link.client.url in only)
        ]
        await asyncio.gather(
            *(self._connect(members, failed) for members in partition(todo, self.group_size))
        )
        if failed:
            raise WeightPushError(failed)

    def _merge_fragments(self) -> None:
        """Drops every group under half ``group_size`` when two or more such groups, or one and
        engines with no group, could be one; their members are grouped afresh by ``connect``."""
        if self.group_size == 1:
            return
        small = max(2, self.group_size // 2)
        fragments = [g for g in self._groups if g.pg is not None and len(g.members) < small]
        ungrouped = any(link.pg is None for link in self.healthy_links)
        if len(fragments) + ungrouped < 2:
            return
        for group in fragments:
            drop_group(group.members[0])

    async def _connect(self, members: list[EngineLink], failed: dict[str, str]) -> None:
        self._generation += 1
        group = await build_group(
            members,
            f"{self.group_prefix}_{self._generation}",
            failed,
            master_address=self.master_address,
            master_port=self.master_port,
            timeout_s=self.timeout_s,
            control_timeout_s=self.control_timeout_s,
            load_format=self.load_format,
        )
        if group is not None:
            self._groups.append(group)

    def _targets(self, only: set[str] | None) -> list[EngineLink]:
        """The healthy engines of ``only`` (all without it), with every member of their groups: a
        broadcast reaches a group whole."""
        named = {
            id(member)
            for link in self.healthy_links
            if only is None or link.client.url in only
            for member in link.members
        }
        return [link for link in self.healthy_links if id(link) in named]

    def _report(
        self, targets: list[EngineLink], failed: dict[str, str], version: str | int, start: float, sent: int
    ) -> PushReport:
        """The push's report, once its failed engines are marked unhealthy and their groups dropped."""
        for link in targets:
            if link.name in failed:
                link.healthy = False
                drop_group(link)
        report = PushReport(
            version=str(version),
            seconds=time.perf_counter() - start,
            bytes_per_engine=sent,
            engines=[link.name for link in targets if link.name not in failed],
            failed=failed,
            unchecked=[
                link.name
                for link in targets
                if self.verify_tensors and not link.verifiable and link.name not in failed
            ],
            groups=len(
                {id(link.group) for link in targets if link.name not in failed and link.group is not None}
            ),
        )
        if failed and not report.engines:
            raise WeightPushError(failed)
        return report

    async def verify(self, sample: dict[str, torch.Tensor], truncate_size: int = 100) -> dict[str, list[str]]:
        """Compares a sample of tensors with what each healthy engine holds (``/get_weights_by_name``).
        Returns the names that differ, by engine (empty lists when everything matches)."""
        rows = {name: first_rows(t, truncate_size) for name, t in sample.items()}
        return {link.name: await differing(link.client, rows, truncate_size) for link in self.healthy_links}

    async def close(self) -> None:
        """Every engine destroys its side of its groups, the dropped ones not yet retired included."""
        self._packer.forget()
        await self._retire_dropped()
        for link in self.links:
            await close_link(link, self.control_timeout_s)

    async def _retire_dropped(self) -> None:
        dropped = [group for group in self._groups if group.pg is None]
        self._groups = [group for group in self._groups if group.pg is not None]
        await asyncio.gather(*(retire(group, self.links, self.control_timeout_s) for group in dropped))
