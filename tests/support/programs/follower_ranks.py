"""One of the two learner ranks of the command-channel tests (tests/integration/learner/test_commands.py).

Run as ``python -m tests.support.programs.follower_ranks SCENARIO RANK PORT OUT_DIR``. Rank 0 sends as
the learner does (``RankZero``: keep-alive task, commands on its trainer thread); rank 1 runs ``follow``
with a fake trainer and writes what it saw to ``OUT_DIR/rank1.json``. The timeouts are short."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlmesh.learner.run.commands import Followers

DEFAULT_GROUP_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 3.0
KEEPALIVE_S = 0.5
# Rank 0 is silent this long before its first command: longer than both timeouts.
SILENT_S = COMMAND_TIMEOUT_S + 1.0
RANK1_EXIT_LOST = 3


class FakeTrainer:
    """Records the calls ``follow`` makes; only the methods of the commands sent here."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def save_checkpoint(self, path: str, extra: dict) -> None:
        self.calls.append(["save_checkpoint", path, extra])


async def rank_zero(scenario: str, followers: Followers) -> None:
    """Rank 0 as the learner drives it: its keep-alive and every command on one trainer thread."""
    from rlmesh.learner.run.commands import RankCommand
    from rlmesh.learner.run.trainer_thread import RankZero, TrainerThread

    thread = TrainerThread()
    sender = RankZero(FakeTrainer(), followers, thread)  # rank 0's own part of a save: recorded, unread
    sender.start_keepalive()
    if scenario == "killed":
        await asyncio.Event().wait()  # until the test SIGKILLs or SIGSTOPs this process
    if scenario == "slow":
        # The one sleep: the test is about a wait outlasting the default group's timeout.
        await asyncio.sleep(SILENT_S)
        await sender.run(RankCommand("save", path="/ckpt/step-1", extra={"tag": "global_step_1"}))
    await sender.finish("boom" if scenario == "boom" else "")
    thread.close()


def run_rank(scenario: str, rank: int, port: int, out_dir: Path) -> int:
    import torch.distributed as dist

    from rlmesh.learner.run.commands import Followers, RankZeroLost, follow

    # The store has its own, long timeout: the two processes start (import torch) at their own
    # pace, and only the collectives are meant to have the short one.
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=DEFAULT_GROUP_TIMEOUT_S)
    )
    # Collective, but one rank can be done with it while the other still reads the group's
    # address from the store: the test waits for both files.
    followers = Followers(timedelta(seconds=COMMAND_TIMEOUT_S), KEEPALIVE_S)
    (out_dir / f"rank{rank}.ready").touch()
    if rank == 0:
        asyncio.run(rank_zero(scenario, followers))
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


if __name__ == "__main__":
    scenario, rank, port, out_dir = sys.argv[1:]
    sys.exit(run_rank(scenario, int(rank), int(port), Path(out_dir)))
