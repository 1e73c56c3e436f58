"""The pusher's engine links: one weight group per engine, built, kept across pushes and dropped,
so a replica that dies mid-push breaks only its own group (docs/sglang.md)."""

from __future__ import annotations

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


@dataclass
class EngineLink:
    client: EngineClient
    ranks: int = 1  # the engine's TP size
    backend: str = "gloo"  # of its weight group: weight_sync_backend
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
    link: EngineLink,
    group_name: str,
    failed: dict[str, str],
    *,
    master_address: str,
    master_port: int = 0,
    timeout_s: float,
    control_timeout_s: float,
    load_format: str | None,
) -> None:
    """Builds ``link``'s group (the trainer is rank 0) and settles what the engine is sent; an
    engine that fails is marked unhealthy and listed in ``failed``."""
    link.group_name = group_name
    listen = store_socket(master_address, master_port)
    port = listen.getsockname()[1]
    world = 1 + link.ranks
    own = run_in_daemon_thread(
        functools.partial(
            init_custom_process_group, gloo_interface=gloo_interface_toward(master_address), listen=listen
        ),
        link.backend,
        f"tcp://{bracket(master_address)}:{port}",
        world,
        0,
        group_name,
        timeout_s,
        name="weight-sync",
    )
    try:
        # An engine registered at an address the learner cannot reach would otherwise hold
        # every push up for the whole timeout, once per push.
        if not await link.client.reachable(control_timeout_s):
            raise EngineError(f"{link.name}: /health did not answer within {control_timeout_s:g} s")
        link.load_format = load_format
        if load_format == FLATTENED_BUCKET and not await link.client.supports_flattened_bucket():
            link.load_format = None
            log.warning("engine %s predates load_format=flattened_bucket: pushing it per tensor", link.name)
        await link.client.init_weights_update_group(master_address, port, 1, world, group_name, link.backend)
        link.pg = await own
    except Exception as e:
        link.healthy = False
        failed[link.name] = f"could not build weight group: {e}"
        log.error("engine %s: weight group failed: %s", link.name, e)
        # Our side of the rendezvous gives up at its deadline; don't wait for it here.
        own.add_done_callback(lambda t: t.exception() is None and destroy_process_group(t.result()))


def drop_group(link: EngineLink) -> None:
    if link.pg is not None and link.busy:
        # Destroying a group under a pending collective can abort the process: let it time out.
        log.warning("engine %s: weight group %s left to its deadline", link.name, link.group_name)
    elif link.pg is not None:
        destroy_process_group(link.pg)
    link.pg = None


async def close_link(link: EngineLink) -> None:
    """Asks a healthy engine to destroy its side of the group, then destroys ours."""
    if link.pg is not None and link.healthy:
        try:
            await link.client.destroy_weights_update_group(link.group_name)
        except EngineError as e:
            log.warning("%s", e)
    drop_group(link)
