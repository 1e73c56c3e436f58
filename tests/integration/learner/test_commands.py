"""The command channel from rank 0 to the other learner ranks (``Followers``, ``follow``), with two
real gloo processes.

A follower waits for rank 0's next command while rank 0 waits for batches, pushes weights or holds
a pause: that can take longer than the training group's timeout and the command timeout, and must
not end a healthy run (rank 0's keep-alives cover it), while a rank 0 that hangs must end it. The
two ranks are ``tests/support/programs/follower_ranks.py``, with short timeouts so that a wait can
outlast them within a test."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

from rlmesh.runtime.net import free_port
from tests.support.polling import wait_until
from tests.support.processes import child_env, program
from tests.support.programs.follower_ranks import RANK1_EXIT_LOST
from tests.support.repo import REPO

EXIT_TIMEOUT_S = 60  # bounds every wait for a child; a healthy one is done in seconds
LOST_WITHIN_S = 10  # rank 0's death is seen when its sockets close, not after a timeout


def start(scenario: str, out_dir: Path) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            program("follower_ranks", scenario, rank, port, out_dir),
            cwd=REPO,
            env=child_env(),
        )
        for rank in (0, 1)
    ]


def finish(procs: list[subprocess.Popen]) -> list[int]:
    """Both exit codes; a child still running after EXIT_TIMEOUT_S is killed and fails the test."""
    try:
        return [p.wait(timeout=EXIT_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def rank1_saw(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "rank1.json").read_text())


def test_a_follower_waits_out_both_timeouts_for_a_command_while_rank_zero_lives(tmp_path):
    procs = start("slow", tmp_path)
    assert finish(procs) == [0, 0]
    assert rank1_saw(tmp_path) == {
        "failure": "",
        "calls": [["save_checkpoint", "/ckpt/step-1", {"tag": "global_step_1"}]],
    }


def test_rank_zeros_failure_reaches_the_follower(tmp_path):
    procs = start("boom", tmp_path)
    assert finish(procs) == [0, 0]
    assert rank1_saw(tmp_path) == {"failure": "boom", "calls": []}


def test_a_follower_sees_rank_zero_killed_at_once(tmp_path):
    rank0, rank1 = procs = start("killed", tmp_path)
    try:
        # Both: rank 0 can be past building the group while rank 1 still reads it from the store.
        wait_until(
            lambda: all((tmp_path / f"rank{r}.ready").exists() for r in (0, 1)),
            EXIT_TIMEOUT_S,
            "both Followers",
        )
        rank0.send_signal(signal.SIGKILL)
        # Bounded: without the death noticed, rank 1 would wait out COMMAND_TIMEOUT.
        assert rank1.wait(timeout=LOST_WITHIN_S) == RANK1_EXIT_LOST
    finally:
        finish(procs)
    saw = rank1_saw(tmp_path)
    assert saw["calls"] == [] and "waiting for rank 0's next command failed" in saw["lost"]


def test_a_follower_gives_up_on_a_rank_zero_that_hangs(tmp_path):
    # A stopped process keeps its sockets open, as a host that vanished from the network does:
    # only the silence (no keep-alive for COMMAND_TIMEOUT_S) tells the follower.
    rank0, rank1 = procs = start("killed", tmp_path)
    try:
        # Both: rank 0 can be past building the group while rank 1 still reads it from the store.
        wait_until(
            lambda: all((tmp_path / f"rank{r}.ready").exists() for r in (0, 1)),
            EXIT_TIMEOUT_S,
            "both Followers",
        )
        rank0.send_signal(signal.SIGSTOP)
        assert rank1.wait(timeout=EXIT_TIMEOUT_S) == RANK1_EXIT_LOST
    finally:
        rank0.kill()
        finish(procs)
    saw = rank1_saw(tmp_path)
    assert saw["calls"] == [] and "waiting for rank 0's next command failed" in saw["lost"]
