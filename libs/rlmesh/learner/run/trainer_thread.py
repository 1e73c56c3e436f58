"""Rank 0's one trainer thread: every torch and collective call of a run goes through it, one at a
time, while the event loop does all I/O. docs/design.md#one-steps-concurrency says why."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from rlmesh.learner.run.commands import Followers, RankCommand, run_collective

if TYPE_CHECKING:
    from rlmesh.learner.trainer import PPOTrainer

log = logging.getLogger("rlmesh.learner")

T = TypeVar("T")

Bucket = list[tuple[str, torch.Tensor]]


class TrainerThread:
    """A single-worker executor: calls run in the order they were made, never two at once, and the
    awaiting coroutine leaves the event loop free meanwhile."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlmesh-trainer")
        self._last: Future[Any] | None = None

    async def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        self._last = self._pool.submit(functools.partial(fn, *args, **kwargs))
        return await asyncio.wrap_future(self._last)

    @property
    def idle(self) -> bool:
        """Nothing runs or waits on it (one worker, in order: the last call done means all are)."""
        return self._last is None or self._last.done()

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class RankZero:
    """Rank 0's side of the rank protocol (``rlmesh.learner.run.commands``): each command is
    announced to the followers and run here in one trainer-thread call, a push bucket by bucket,
    and while no command runs a keep-alive goes out every ``followers.keepalive_s``."""

    def __init__(self, trainer: PPOTrainer, followers: Followers, thread: TrainerThread) -> None:
        self.trainer = trainer
        self.followers = followers
        self.thread = thread
        self._keepalive: asyncio.Task[None] | None = None
        self._stop_keepalive = asyncio.Event()
        self._finished = False

    def _announced(self, command: RankCommand) -> Any:
        self.followers.announce(command)
        result = run_collective(self.trainer, command)
        self.followers.done()  # not reached when rank 0's part raised: see Followers.finish
        return result

    async def run(self, command: RankCommand) -> Any:
        """Every rank runs ``command``; returns rank 0's result."""
        return await self.thread.call(self._announced, command)

    def _start_push(self, bucket_bytes: int) -> Iterator[Bucket]:
        command = RankCommand("push", bucket_bytes=bucket_bytes)
        self.followers.announce(command)
        return run_collective(self.trainer, command)

    async def weight_buckets(self, bucket_bytes: int) -> AsyncIterator[Bucket]:
        """The push's buckets, each gathered (collective under ZeRO-3) on the trainer thread. No
        copy: the pusher is done with each bucket (copied into its flat buffer, or sent) before it
        asks for the next, and no optimizer step runs during a push."""
        buckets = await self.thread.call(self._start_push, bucket_bytes)
        while (bucket := await self.thread.call(next, buckets, None)) is not None:
            yield bucket
        await self.thread.call(self.followers.done)  # an abandoned push leaves the followers' state unknown

    def start_keepalive(self) -> None:
        if self.followers.world > 1 and self._keepalive is None:
            self._keepalive = asyncio.create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop_keepalive.wait(), self.followers.keepalive_s)
                return
            except TimeoutError:
                pass
            try:
                # Queued behind a running command: it goes out after it, if the followers are
                # waiting for a command by then (``Followers.keep_alive`` checks).
                await self.thread.call(self.followers.keep_alive)
            except Exception as e:
                log.error("keep-alive to the other ranks failed: %s", e)
                return

    async def finish(self, failure: str = "") -> None:
        """Tells the followers the run is over (``failure``: why it failed, if it did), after the
        keep-alive stopped. Idempotent; never raises."""
        if self._finished:
            return
        self._finished = True
        self._stop_keepalive.set()
        if self._keepalive is not None:
            await self._keepalive  # a no-op under way completes first: never two broadcasts at once
        if not self.thread.idle:
            # The caller of a trainer call was cancelled and the call still runs: whatever it is,
            # a stop queued behind it could wait forever. The followers see this process exit.
            log.error("rank 0 stopped during a trainer call: the other ranks stop when this process exits")
            return
        await self.thread.call(self.followers.finish, failure)
