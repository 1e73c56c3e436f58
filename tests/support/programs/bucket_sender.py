"""Rank 0 of test_bucket's gloo group, in its own process (a process registers a group name once).

Run as ``python -m tests.support.programs.bucket_sender PORT GROUP LOAD_FORMAT``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from rlmesh.weights.bucket import FLATTENED_BUCKET, flatten_tensors
from rlmesh.weights.group import destroy_process_group, init_custom_process_group

ROUNDS = 2


def payload(round_: int) -> dict[str, torch.Tensor]:
    """What round ``round_`` sends: mixed dtypes, one of them landing misaligned."""
    g = torch.Generator().manual_seed(round_)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 bytes: "c" lands misaligned
        "c": torch.randint(0, 2**40, (2, 3), generator=g),
        "d": torch.randn(2, 2, generator=g).to(torch.float16),
    }


def send(port: int, group: str, load_format: str) -> None:
    """Broadcasts ``payload(round)`` for each round, as the pusher does, then leaves with the receiver."""
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group, 60.0)
    for round_ in range(ROUNDS):
        tensors = list(payload(round_).values())
        if load_format == FLATTENED_BUCKET:
            dist.broadcast(flatten_tensors(tensors), src=0, group=pg)
        else:
            for t in tensors:
                dist.broadcast(t.contiguous(), src=0, group=pg)
    dist.barrier(group=pg)  # the receiver is done: leave together
    destroy_process_group(pg)


if __name__ == "__main__":
    send(int(sys.argv[1]), sys.argv[2], sys.argv[3])
