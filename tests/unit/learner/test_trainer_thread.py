"""Rank 0's one trainer thread: every trainer call (a command, each bucket's gather of a push, the
stop) runs on the same thread, never the event loop's, in the order made, and the loop stays free
while one runs. One rank here (no torch.distributed group): the channel itself is test_commands'."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import torch

from rlmesh.learner.run.commands import Followers, RankCommand
from rlmesh.learner.run.trainer_thread import RankZero, TrainerThread
from rlmesh.learner.weight_sync.push import WeightPusher

GUARD_S = 30  # bounds a wait that would otherwise hang the test; a pass takes milliseconds


class RecordingTrainer:
    """Records which thread each trainer method ran on, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def _record(self, name: str) -> None:
        self.calls.append((name, threading.get_ident()))

    def train_step(self, batch: object, kl_ctrl: object) -> dict[str, float]:
        self._record("train")
        return {"actor/pg_loss": 0.5}

    def named_weights_for_push(
        self, bucket_bytes: int, copy: bool
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for i in range(3):
            self._record("gather")  # under ZeRO-3 a collective: it must not run on the event loop
            yield [(f"layer{i}.weight", torch.full((2, 2), float(i)))]

    def save_checkpoint(self, path: str, extra: dict) -> None:
        self._record("save")


async def test_every_trainer_call_of_a_step_runs_on_one_thread_that_is_not_the_loops():
    trainer = RecordingTrainer()
    thread = TrainerThread()
    rank_zero = RankZero(trainer, Followers(), thread)
    trained = await rank_zero.run(RankCommand("train"))
    # The pusher consumes the buckets as the learner's push does; no engine is listed, so the
    # buckets are gathered and counted but sent nowhere.
    report = await WeightPusher([]).push_buckets(rank_zero.weight_buckets(1 << 20), version=1)
    await rank_zero.run(RankCommand("save", path="/ckpt", extra={}))
    await rank_zero.finish()
    thread.close()

    assert trained == {"actor/pg_loss": 0.5}
    assert report.bytes_per_engine == 3 * 4 * 4  # three 2x2 float32 buckets, each asked for in turn
    assert [name for name, _ in trainer.calls] == ["train", "gather", "gather", "gather", "save"]
    threads = {ident for _, ident in trainer.calls}
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_the_loop_runs_while_a_trainer_call_does():
    thread = TrainerThread()
    started, release = threading.Event(), threading.Event()

    def blocking() -> bool:
        started.set()
        return release.wait(GUARD_S)  # False only if the loop could not set it meanwhile

    assert thread.idle
    call = asyncio.create_task(thread.call(blocking))
    assert await asyncio.to_thread(started.wait, GUARD_S)
    assert not thread.idle
    release.set()  # from the loop, while the call is under way
    assert await call
    assert thread.idle
    thread.close()


async def test_calls_run_in_the_order_they_were_made():
    thread = TrainerThread()
    order: list[int] = []
    await asyncio.gather(*(thread.call(order.append, i) for i in range(20)))
    thread.close()
    assert order == list(range(20))
