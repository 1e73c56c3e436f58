"""The command channel from rank 0 to the other learner ranks (``Followers``, ``follow``), with two
real gloo processes.

A follower waits for rank 0's next command while rank 0 waits for batches, pushes weights or holds
a pause: that can take longer than the training group's timeout and the command timeout, and must
not end a healthy run (rank 0's keep-alives cover it), while a rank 0 that hangs must end it. Here
the timeouts are made short so that a wait can outlast them within a test.

The processes are this file run as a script: ``python -m tests.integration.learner.test_followers
SCENARIO RANK PORT OUT_DIR``. Rank 1 runs ``follow`` with a fake trainer (this tests the channel,
not training) and writes what it saw to ``OUT_DIR/rank1.json``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from rlmesh.runtime.net import free_port
from tests.helpers import child_env, wait_until

REPO = Path(__file__).resolve().parents[3]
DEFAULT_GROUP_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 3.0
KEEPALIVE_S = 0.5
# Rank 0 is silent this long before its first command: longer than both timeouts.
SILENT_S = COMMAND_TIMEOUT_S + 1.0
RANK1_EXIT_LOST = 3
EXIT_TIMEOUT_S = 60  # bounds every wait for a child; a healthy one is done in seconds
LOST_WITHIN_S = 10  # rank 0's death is seen when its sockets close, not after a timeout


# ----- the two ranks (child processes) -----


class FakeTrainer:
    """Records the calls ``follow`` makes; only the methods of the commands sent here."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def save_checkpoint(self, path: str, extra: dict) -> None:
        self.calls.append(["save_checkpoint", path, extra])


def run_rank(scenario: str, rank: int, port: int, out_dir: Path) -> int:
    import torch.distributed as dist

    from rlmesh.learner.commands import Followers, RankCommand, RankZeroLost, follow

    # The store has its own, long timeout: the two processes start (import torch) at their own
    # pace, and only the collectives are meant to have the short one.
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=DEFAULT_GROUP_TIMEOUT_S)
    )
    followers = Followers(
        timedelta(seconds=COMMAND_TIMEOUT_S), KEEPALIVE_S
    )  # collective: both ranks are past it once either is
    (out_dir / f"rank{rank}.ready").touch()
    if rank == 0:
        if scenario == "killed":
            signal.pause()  # until the test SIGKILLs or SIGSTOPs this process
        if scenario == "slow":
            # The one sleep: the test is about a wait outlasting the default group's timeout.
            time.sleep(SILENT_S)
            followers.announce(RankCommand("save", path="/ckpt/step-1", extra={"tag": "global_step_1"}))
            followers.done()
        followers.finish("boom" if scenario == "boom" else "")
        dist.destroy_process_group()  # as the learner does: gloo's threads must not outlive the exit
        return 0
    trainer = FakeTrainer()
    try:
        failure = follow(trainer, followers)
    except RankZeroLost as e:
        (out_dir / "rank1.json").write_text(json.dumps({"lost": str(e), "calls": trainer.calls}))
        # As the learner's follower does: groups whose peer is gone can abort the interpreter's exit.
        os._exit(RANK1_EXIT_LOST)
    (out_dir / "rank1.json").write_text(json.dumps({"failure": failure, "calls": trainer.calls}))
    dist.destroy_process_group()
    return 0


# ----- the tests -----


def start(scenario: str, out_dir: Path) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.learner.test_followers",
                scenario,
                str(rank),
                str(port),
                str(out_dir),
            ],
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
        wait_until(lambda: (tmp_path / "rank0.ready").exists(), EXIT_TIMEOUT_S, "rank 0's Followers")
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
        wait_until(lambda: (tmp_path / "rank0.ready").exists(), EXIT_TIMEOUT_S, "rank 0's Followers")
        rank0.send_signal(signal.SIGSTOP)
        assert rank1.wait(timeout=EXIT_TIMEOUT_S) == RANK1_EXIT_LOST
    finally:
        rank0.kill()
        finish(procs)
    saw = rank1_saw(tmp_path)
    assert saw["calls"] == [] and "waiting for rank 0's next command failed" in saw["lost"]


if __name__ == "__main__":
    scenario, rank, port, out_dir = sys.argv[1:]
    sys.exit(run_rank(scenario, int(rank), int(port), Path(out_dir)))
