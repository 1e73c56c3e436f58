"""A torch.distributed process group built the way SGLang builds its weight-update group, so the
trainer and an SGLang server meet in it; its host's store listens on one address, not on all as
torch's would. docs/design.md#buckets-groups-and-names"""

from __future__ import annotations

import errno
import inspect
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_OPTIONS_KW = (
    "backend_options"
    if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
    else "pg_options"
)

# gloo reads its interface from this variable when a group is made: an operator's setting wins.
_GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_pinned = threading.Condition()
_pins: dict[str, int] = {}  # interface -> groups being made on it now


@contextmanager
def pinned_gloo_interface(name: str | None) -> Iterator[None]:
    # Groups made at once in one process share the variable: they wait for one another only
    # when they want different interfaces.
    with _pinned:
        if os.environ.get(_GLOO_IFNAME) and not _pins:
            name = None  # set by the operator, not by us
        if name:
            _pinned.wait_for(lambda: not _pins or name in _pins)
            _pins[name] = _pins.get(name, 0) + 1
            os.environ[_GLOO_IFNAME] = name
    try:
        yield
    finally:
        if name:
            with _pinned:
                _pins[name] -= 1
                if not _pins[name]:
                    del _pins[name]
                    os.environ.pop(_GLOO_IFNAME, None)
                    _pinned.notify_all()


def listen_socket(host: str, first_port: int = 0) -> socket.socket:
    """A listening TCP socket bound to ``host`` (an address or a name of this machine) alone: on the
    OS's port, or with ``first_port`` > 0 the lowest free one from it up (for a firewall that opens
    a range).

    Raises:
        OSError: ``host`` is not an address of this machine (EADDRNOTAVAIL), or no port is free.
    """
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)[0]
    for port in range(first_port, 65536) if first_port > 0 else (0,):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free
        try:
            sock.bind((address[0], port, *address[2:]))
            sock.listen(128)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                continue
            raise
        return sock
    raise OSError(errno.EADDRINUSE, f"no free TCP port on {host} from {first_port} to 65535")


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
    *,
    gloo_interface: str | None = None,
    listen: socket.socket | None = None,
) -> dist.ProcessGroup:
    """Joins (rank > 0) or hosts (rank 0) the group; blocks until all ``world_size`` ranks arrive
    or ``timeout_s`` passes. Every later collective on the group has the same deadline.

    ``gloo_interface``: the network interface this rank's gloo transport listens on and tells its
    peers (None: gloo's default, the address the hostname resolves to, often loopback).
    ``listen``: rank 0's store serves on this socket (:func:`listen_socket`, on the port of
    ``init_method``) and takes it over; without it the store listens on every interface."""
    timeout = timedelta(seconds=timeout_s)
    if listen is not None and rank == 0:
        store: dist.Store = dist.TCPStore(
            listen.getsockname()[0],
            listen.getsockname()[1],
            world_size,
            is_master=True,
            timeout=timeout,
            master_listen_fd=listen.detach(),  # the store closes it
        )
    else:
        store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    with pinned_gloo_interface(gloo_interface if c10d.Backend(backend) == "gloo" else None):
        pg, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            c10d.Backend(backend),
            store,
            group_name=group_name,
            timeout=timeout,
            **{_OPTIONS_KW: None},
        )
    # Collectives look the group's ranks up here; SGLang registers its group the same way.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(pg: dist.ProcessGroup) -> None:
    try:
        dist.destroy_process_group(pg)
    except (AssertionError, RuntimeError, ValueError, KeyError):
        # Not fully registered with c10d's bookkeeping: shut the backend down directly.
        c10d._world.pg_group_ranks.pop(pg, None)
        if hasattr(pg, "shutdown"):
            pg.shutdown()
