"""A collective of the learner's ranks fails once ``actor_rollout_ref.nccl_timeout`` has passed
without the other ranks (torch's default would wait 30 minutes). Two real processes
(``tests/support/programs/collective_ranks.py``) join a gloo group through ``init_distributed`` as
a launcher's ranks do; rank 1 then never takes part. Rank 0 then exits with its own code: its group
is torn down before the interpreter finalizes, where gloo's threads would abort it (-6)."""

from __future__ import annotations

import subprocess

from rlmesh.runtime.net import free_port
from tests.support.processes import child_env, program
from tests.support.repo import REPO

TIMEOUT_S = 3.0


def test_a_collective_without_the_other_rank_fails_after_the_configured_timeout(tmp_path):
    port = free_port()
    out = tmp_path / "rank0.txt"
    procs = [
        subprocess.Popen(
            program("collective_ranks", rank, port, TIMEOUT_S, out),
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
        code = procs[0].wait(timeout=300)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    result, _, at_exit = out.read_text().rpartition("\n")
    # Its own exit code, not -6: gloo aborts a process whose group outlives the interpreter.
    assert code == 0, f"rank 0 exited with {code}; it wrote: {result!r}"
    assert result.startswith("failed:"), result
    assert "timeout" in result.lower() or "timed out" in result.lower(), result
    assert at_exit == "group at exit: destroyed", at_exit
