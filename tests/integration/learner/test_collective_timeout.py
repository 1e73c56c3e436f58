"""A collective of the learner's ranks fails once ``actor_rollout_ref.nccl_timeout`` has passed
without the other ranks (torch's default would wait 30 minutes). Two real processes join a gloo
group through ``init_distributed`` as a launcher's ranks do; rank 1 then never takes part.

Run as a script by the test: ``python -m tests.integration.learner.test_collective_timeout RANK
PORT TIMEOUT_S OUT``."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from rlmesh.runtime.net import free_port
from tests.helpers import child_env

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 3.0


def run_rank(rank: int, port: int, timeout_s: float, out: Path) -> int:
    import torch
    import torch.distributed as dist

    from rlmesh.learner.dist import init_distributed

    init_distributed("gloo", timeout_s=timeout_s)
    if rank == 1:
        signal.pause()  # alive, its sockets open, but never in the collective
    try:
        dist.all_reduce(torch.ones(1))
        out.write_text("completed")
    except RuntimeError as e:
        out.write_text(f"failed: {e}")
    return 0


def test_a_collective_without_the_other_rank_fails_after_the_configured_timeout(tmp_path):
    port = free_port()
    out = tmp_path / "rank0.txt"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.learner.test_collective_timeout",
                str(rank),
                str(port),
                str(TIMEOUT_S),
                str(out),
            ],
            cwd=REPO,
            env=child_env(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                DS_ACCELERATOR="cpu",
            ),
        )
        for rank in (0, 1)
    ]
    try:
        # Rank 0 returns once its all_reduce failed; with torch's default it would block 30 min.
        assert procs[0].wait(timeout=300) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    result = out.read_text()
    assert result.startswith("failed:"), result
    assert "timeout" in result.lower() or "timed out" in result.lower(), result


if __name__ == "__main__":
    rank, port, timeout_s, out = sys.argv[1:]
    sys.exit(run_rank(int(rank), int(port), float(timeout_s), Path(out)))
