"""The pusher's engine links and their weight groups, built, kept across pushes and dropped. By
default each engine has a group of its own, so a replica that dies mid-push breaks only its own;
``group_size`` > 1 shares one group (one broadcast) among that many engines (docs/sglang.md)."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from rlmesh.engine.client import EngineClient, EngineError
from rlmesh.runtime.net import WILDCARD_IPV4, bracket, gloo_interface_toward
from rlmesh.runtime.threads import run_in_daemon_thread
from rlmesh.weights.bucket import FLATTENED_BUCKET
from rlmesh.weights.group import destroy_process_group, init_custom_process_group, listen_socket

log = logging.getLogger("rlmesh.weights")

# The pusher's load_format that settles each group's: per tensor for a gloo group of several
# engines, flattened buckets otherwise.
AUTO_FORMAT = "auto"


@dataclass(eq=False)
class WeightGroup:
    """One process group: the trainer as rank 0, then each member's ranks in order."""

    name: str
    backend: str
    members: list[EngineLink]
    pg: dist.ProcessGroup | None = None
    # A broadcast on it may still be pending (abandoned when an engine refused the update before
    # receiving): it must not be destroyed under it.
    busy: bool = False

    @property
    def world_size(self) -> int:
        return 1 + sum(m.ranks for m in self.members)

    def rank_offset(self, link: EngineLink) -> int:
        offset = 1
        for member in self.members:
            if member is link:
                return offset
            offset += member.ranks
        raise ValueError(f"{link.name} is not a member of weight group {self.name}")


@dataclass(eq=False)
class EngineLink:
    client: EngineClient
    ranks: int = 1  # the engine's TP size
    backend: str = "gloo"  # of its weight group: weight_sync_backend
    group: WeightGroup | None = None
    healthy: bool = True
    # What this engine is sent: the pusher's load_format, or per tensor for a server too old for it.
    load_format: str | None = None
    # False once the engine said it cannot answer /get_weights_by_name (SGLang's Qwen2 cannot).
    verifiable: bool = True

    @property
    def name(self) -> str:
        return self.client.name

    @property
    def pg(self) -> dist.ProcessGroup | None:
        return self.group.pg if self.group is not None else None

    @property
    def group_name(self) -> str:
        return self.group.name if self.group is not None else ""

    @property
    def members(self) -> list[EngineLink]:
        """The engines a broadcast to this one reaches: its group's members, or itself alone."""
        return self.group.members if self.group is not None else [self]


def weight_sync_backend(configured: str, trainer_device: str, engine_device: str) -> str:
    """The backend of one engine's weight group: ``rlmesh.weight_sync.backend`` unless ``auto``;
    then NCCL only when both ends hold their weights on CUDA (the trainer's ``trainer.device`` as
    this machine honours it, the engine's ``device`` as its /server_info says), else gloo, which
    also carries CUDA tensors to a CPU engine."""
    if configured != "auto":
        return configured
    return "nccl" if trainer_device == "cuda" and engine_device == "cuda" else "gloo"


def relink(
    links: Sequence[EngineLink],
    clients: Sequence[EngineClient],
    ranks: Sequence[int],
    backends: Sequence[str],
) -> tuple[list[EngineLink], list[EngineClient]]:
    """Links for exactly ``clients`` (by URL), each bringing ``ranks`` to its group over ``backends``,
    and the clients no longer used. A known healthy engine keeps its link and group; a new one, one
    that failed before, or one whose ranks or backend changed, gets a fresh link."""
    by_url = {link.client.url: link for link in links}
    kept, unused = [], []
    for client, n_ranks, backend in zip(clients, ranks, backends, strict=True):
        link = by_url.pop(client.url, None)
        if link is not None and (not link.healthy or link.ranks != n_ranks or link.backend != backend):
            drop_group(link)
            if link.client is not client:
                unused.append(link.client)
            link = None
        if link is None:
            link = EngineLink(client=client, ranks=n_ranks, backend=backend)
        elif link.client is not client:
            unused.append(client)
        kept.append(link)
    for gone in by_url.values():
        drop_group(gone)
        unused.append(gone.client)
    return kept, unused


def partition(links: Sequence[EngineLink], group_size: int) -> list[list[EngineLink]]:
    """``links`` in groups of at most ``group_size`` engines of one backend, in their order."""
    by_backend: dict[str, list[EngineLink]] = {}
    for link in links:
        by_backend.setdefault(link.backend, []).append(link)
    return [same[i : i + group_size] for same in by_backend.values() for i in range(0, len(same), group_size)]


def store_socket(master_address: str, first_port: int = 0) -> socket.socket:
    """Where the learner's side of a weight group listens: ``master_address``, the address engines
    are told to dial, and only there. Where that is not an address of this machine (behind NAT or
    a port forward) every interface, with a warning: set rlmesh.weight_sync.master_address or
    rlmesh.learner.advertise_address to one of its own addresses to avoid that."""
    try:
        return listen_socket(master_address, first_port)
    except socket.gaierror:
        pass  # a name only the engines resolve
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise
    log.warning(
        "weight groups: %s, where engines dial the learner, is not an address of this machine (NAT?): "
        "their rendezvous listens on every interface",
        master_address,
    )
    return listen_socket(WILDCARD_IPV4, first_port)


async def build_group(
    members: Sequence[EngineLink],
    group_name: str,
    failed: dict[str, str],
    *,
    master_address: str,
    master_port: int = 0,
    timeout_s: float,
    control_timeout_s: float,
    load_format: str | None,
) -> WeightGroup | None:
    """Builds one group for ``members`` (one backend; the trainer is rank 0) and settles what each
    engine is sent. Every member is checked reachable before any is asked to join, so that a dead
    one fails the group at once instead of leaving the others in the rendezvous until its deadline.
    Where one fails, every member is marked unhealthy and listed in ``failed``."""
    group = WeightGroup(group_name, members[0].backend, list(members))
    if load_format == AUTO_FORMAT:
        # gloo broadcasts along a binomial tree whose ranks forward a broadcast only once they hold
        # all of it: one flattened bucket crosses the levels one after another, successive
        # tensors overlap (docs/scale.md#shared-weight-groups).
        load_format = None if group.backend == "gloo" and len(members) > 1 else FLATTENED_BUCKET
    listen = store_socket(master_address, master_port)
    port = listen.getsockname()[1]
    own = run_in_daemon_thread(
        functools.partial(
            init_custom_process_group, gloo_interface=gloo_interface_toward(master_address), listen=listen
        ),
        group.backend,
        f"tcp://{bracket(master_address)}:{port}",
        group.world_size,
        0,
        group_name,
        timeout_s,
        name="weight-sync",
    )
    why: dict[str, str] = {}

    async def settle_format(link: EngineLink) -> None:
        # An engine registered at an address the learner cannot reach would otherwise hold
        # every push up for the whole timeout, once per push.
        if not await link.client.reachable(control_timeout_s):
            raise EngineError(f"{link.name}: /health did not answer within {control_timeout_s:g} s")
        link.load_format = load_format
        if load_format == FLATTENED_BUCKET and not await link.client.supports_flattened_bucket():
            link.load_format = None
            log.warning("engine %s predates load_format=flattened_bucket: pushing it per tensor", link.name)

    async def settle_each() -> None:
        async def one(link: EngineLink) -> None:
            try:
                await settle_format(link)
            except Exception as e:
                why[link.name] = str(e)

        await asyncio.gather(*(one(link) for link in members))

    async def join_all() -> None:
        # Each join returns once every rank arrived: the first to fail ends the wait for the rest.
        joins = {
            asyncio.create_task(
                link.client.init_weights_update_group(
                    master_address, port, group.rank_offset(link), group.world_size, group_name, group.backend
                )
            ): link.name
            for link in members
        }
        done, pending = await asyncio.wait([*joins, own], return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            if task is not own:
                task.cancel()
        for task in done:
            if task.exception() is not None:
                why[joins.get(task, "the trainer")] = str(task.exception())

    await settle_each()
    if len({link.load_format for link in members}) > 1:
        # One broadcast serves the whole group: where one member predates flattened_bucket, all
        # are sent tensor by tensor.
        for link in members:
            link.load_format = None
    if not why:
        await join_all()
    if why:
        for link in members:
            link.healthy = False
            cause = why.get(link.name) or f"another engine of its group failed: {', '.join(why)}"
            failed[link.name] = f"could not build weight group: {cause}"
            log.error("engine %s: weight group failed: %s", link.name, cause)
        # Our side of the rendezvous gives up at its deadline; don't wait for it here.
        own.add_done_callback(lambda t: t.exception() is None and destroy_process_group(t.result()))
        return None
    group.pg = own.result()
    for link in members:
        link.group = group
    log.info(
        "weight group %s: %s (%d ranks, %s, sent %s)",
        group_name,
        ", ".join(m.name for m in members),
        group.world_size,
        group.backend,
        "in flattened buckets" if members[0].load_format == FLATTENED_BUCKET else "tensor by tensor",
    )
    return group


def drop_group(link: EngineLink) -> None:
    """Drops ``link``'s group, for every member of it (they get a fresh one at the next connect)."""
    group = link.group
    if group is None:
        return
    for member in group.members:
        member.group = None
    if group.busy:
        # Destroying a group under a pending collective can abort the process: let it time out.
        log.warning("weight group %s (%s) left to its deadline", group.name, link.name)
    elif group.pg is not None:
        destroy_process_group(group.pg)
    group.pg = None


async def retire(group: WeightGroup, still_linked: Sequence[EngineLink], timeout_s: float) -> None:
    """Asks the members of a dropped group that are still linked and healthy to destroy their side
    of it: a group spent by another member's failure would otherwise stay open on them."""

    async def one(member: EngineLink) -> None:
        try:
            await asyncio.wait_for(member.client.destroy_weights_update_group(group.name), timeout_s)
        except (EngineError, OSError, TimeoutError) as e:
            log.warning("engine %s: weight group %s not destroyed: %s", member.name, group.name, e)

    linked = {id(link) for link in still_linked if link.healthy}
    await asyncio.gather(*(one(m) for m in group.members if id(m) in linked))


async def close_link(link: EngineLink, timeout_s: float) -> None:
    """Asks every healthy member of ``link``'s group to destroy its side of it, then destroys ours."""
    if link.group is not None:
        await retire(link.group, link.group.members, timeout_s)
    drop_group(link)
