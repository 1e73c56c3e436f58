"""A torch.distributed process group built the way SGLang builds its weight-update group, so the
trainer and an SGLang server meet in it. docs/design.md#buckets-groups-and-names"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_OPTIONS_KW = (
    "backend_options"
    if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
    else "pg_options"
)


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float
) -> dist.ProcessGroup:
    """Joins (rank > 0) or hosts (rank 0) the group; blocks until all ``world_size`` ranks arrive
    or ``timeout_s`` passes. Every later collective on the group has the same deadline."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
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
