"""One of the two learner ranks of the collective timeout test (tests/integration/learner/test_dist.py):
both join a gloo group through ``init_distributed``; rank 1 then never takes part in a collective.

Run as ``python -m tests.support.programs.collective_ranks RANK PORT TIMEOUT_S OUT`` with the
launcher's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; rank 0 writes the outcome to OUT,
then, as the interpreter exits, whether the group was still there."""

from __future__ import annotations

import atexit
import signal
import sys
from pathlib import Path


def run_rank(rank: int, port: int, timeout_s: float, out: Path) -> int:
    import torch
    import torch.distributed as dist

    from rlmesh.learner.dist import init_distributed

    def record_group_at_exit() -> None:
        # Registered before init_distributed, so it runs after the handler that one adds (atexit
        # runs the last registered first), just before the interpreter finalizes.
        with out.open("a") as f:
            f.write(f"\ngroup at exit: {'alive' if dist.is_initialized() else 'destroyed'}")

    atexit.register(record_group_at_exit)
    init_distributed("gloo", timeout_s=timeout_s)
    if rank == 1:
        signal.pause()  # alive, its sockets open, but never in the collective
    try:
        dist.all_reduce(torch.ones(1))
        out.write_text("completed")
    except RuntimeError as e:
        out.write_text(f"failed: {e}")
    # No shutdown_distributed: this rank leaves the way a failed rank may, by returning, and
    # relies on init_distributed to have the group torn down before the interpreter finalizes.
    return 0


if __name__ == "__main__":
    rank, port, timeout_s, out = sys.argv[1:]
    sys.exit(run_rank(int(rank), int(port), float(timeout_s), Path(out)))
