"""The learner's rank protocol: rank 0 announces a ``RankCommand`` to the other ranks, then every
rank runs it through the one table ``COLLECTIVES``. docs/design.md#learner-ranks tells why the
commands have their own gloo group, keep-alives and a bounded wait."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from rlmesh.algo.kl import KLController
    from rlmesh.learner.ppo.batch import PPOBatch
    from rlmesh.learner.trainer import PPOTrainer

log = logging.getLogger("rlmesh.learner")

# A follower waits for rank 0's next command while rank 0 waits for replicas or batches or holds
# a pause, which can be hours. So that the wait can still be bounded tightly, rank 0 sends a no-op
# every KEEPALIVE_S while it runs no collective; a follower that hears nothing for COMMAND_TIMEOUT
# takes rank 0 for gone. (A dead rank 0 is seen at once, its sockets close; the bound is for a
# rank 0 that hangs or whose host vanished silently.)
KEEPALIVE_S = 30.0
COMMAND_TIMEOUT = timedelta(seconds=10 * KEEPALIVE_S)


@dataclass(frozen=True)
class RankCommand:
    """What every rank runs next. ``kind`` is a key of ``COLLECTIVES``, or ``noop`` (a keep-alive)
    or ``stop`` (the run is over; ``failure`` says why it failed, "" when it did not)."""

    kind: str
    batch: PPOBatch | None = None  # train
    kl_ctrl: KLController | None = None  # train
    hparams: dict[str, float] = field(default_factory=dict)  # train: applied before the step
    bucket_bytes: int = 0  # push
    path: str = ""  # save, load, export
    extra: dict[str, Any] | None = None  # save: the loop's state kept with the checkpoint
    background: bool = False  # save: written while training goes on
    failure: str = ""  # stop


def _train(trainer: PPOTrainer, c: RankCommand) -> dict[str, float]:
    if c.hparams:
        trainer.update_hyperparams(**c.hparams)
    return trainer.train_step(c.batch, c.kl_ctrl)


# Each returns rank 0's result; ``push`` returns the buckets' iterator, which every rank must
# exhaust (gathering the weights is collective under ZeRO-3).
COLLECTIVES: dict[str, Callable[[PPOTrainer, RankCommand], Any]] = {
    "train": _train,
    "push": lambda trainer, c: trainer.named_weights_for_push(c.bucket_bytes, copy=False),
    # Written in the background (rlmesh.learner.async_checkpoint) only when the command says so.
    "save": lambda trainer, c: (
        trainer.save_checkpoint(c.path, c.extra, background=True)
        if c.background
        else trainer.save_checkpoint(c.path, c.extra)
    ),
    "wait_for_checkpoint": lambda trainer, c: trainer.wait_for_checkpoint(),
    "load": lambda trainer, c: trainer.load_checkpoint(c.path),
    "export": lambda trainer, c: trainer.export_hf(c.path, None),
}


def run_collective(trainer: PPOTrainer, command: RankCommand) -> Any:
    try:
        run = COLLECTIVES[command.kind]
    except KeyError:
        raise ValueError(f"unknown command from rank 0: {command.kind!r}") from None
    return run(trainer, command)


class RankZeroLost(RuntimeError):
    """A follower's wait for rank 0's next command failed: rank 0 is gone."""


class Followers:
    """Rank 0's channel to the other ranks. Constructing it is collective: every rank builds one,
    at the same point. Rank 0 calls every other method on its trainer thread
    (``rlmesh.learner.run.trainer_thread``), one at a time, so none needs a lock.

    Rank 0 ends the run with :meth:`finish`, which sends ``stop``, but only while the followers
    are known to be waiting for a command: after rank 0's part of a collective failed, a follower
    may still be inside it, and a broadcast it does not expect would hang both. Such a follower
    instead sees rank 0's process exit (its sockets close) and exits too.
    """

    def __init__(self, timeout: timedelta = COMMAND_TIMEOUT, keepalive_s: float = KEEPALIVE_S) -> None:
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        # Its own gloo group: the wait is bounded by ``timeout``, not the training group's, and
        # pickles never touch a GPU.
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.world > 1 else None
        self.keepalive_s = keepalive_s  # rank 0 sends a no-op this often while no command runs
        # Rank 0: a command was announced and rank 0's own part of it has not completed.
        self.in_collective = False
        self.finished = False

    def keep_alive(self) -> None:
        """Rank 0: a no-op, unless the followers are inside a command (not waiting for one) or
        were told to stop. Raises ``RuntimeError`` when the broadcast fails."""
        if self.world > 1 and not self.in_collective and not self.finished:
            dist.broadcast_object_list([RankCommand("noop")], src=0, group=self.group)

    def announce(self, command: RankCommand) -> None:
        """Rank 0: send ``command``; call :meth:`done` once rank 0's own part of it completed."""
        if self.world > 1:
            self.in_collective = True
            dist.broadcast_object_list([command], src=0, group=self.group)

    def done(self) -> None:
        self.in_collective = False

    def finish(self, failure: str = "") -> None:
        """Rank 0: tell the followers the run is over (``failure``: why it failed, if it did).
        Idempotent; never raises (a follower that already died cannot be told)."""
        if self.world == 1 or self.finished:
            return
        self.finished = True
        if self.in_collective:
            log.error("rank 0 stopped inside a collective: the other ranks stop when this process exits")
            return
        try:
            dist.broadcast_object_list([RankCommand("stop", failure=failure)], src=0, group=self.group)
        except RuntimeError as e:
            log.error("could not tell the other ranks to stop: %s", e)

    def receive(self) -> RankCommand:
        """Ranks > 0: the next command; raises ``RankZeroLost`` when rank 0 is gone."""
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as e:
            raise RankZeroLost(f"waiting for rank 0's next command failed: {e}") from e
        return box[0]


def follow(trainer: PPOTrainer, followers: Followers) -> str:
    """Ranks > 0: run the collectives rank 0 announces, until it says stop.

    Returns:
        rank 0's failure, or "" when its run ended normally.

    Raises:
        RankZeroLost: rank 0 died (or its host vanished) without saying stop.
    """
    while True:
        command = followers.receive()
        if command.kind == "stop":
            return command.failure
        if command.kind == "noop":
            continue
        result = run_collective(trainer, command)
        if command.kind == "push":
            collections.deque(result, maxlen=0)  # this rank's buckets are empty; the gather is not
