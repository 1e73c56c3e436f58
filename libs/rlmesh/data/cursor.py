"""The training-set cursor: which prompts come next, resumable exactly from a checkpoint.

docs/internals.md#rlmeshdatacursor"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import numpy as np

from rlmesh.data.dataset import PromptItem, _cfg_get


def total_training_steps(cfg: Any, dataset_len: int) -> int:
    """verl: ``trainer.total_training_steps``, else ``trainer.total_epochs`` x batches per epoch
    (``dataset_len // data.train_batch_size``, at least 1)."""
    if cfg.trainer.total_training_steps:
        return int(cfg.trainer.total_training_steps)
    return cfg.trainer.total_epochs * max(1, dataset_len // cfg.data.train_batch_size)


class PromptCursor:
    """Hands out batches of dataset indices (or items) epoch after epoch."""

    def __init__(
        self, dataset: Sized | int, *, shuffle: bool = True, seed: int | None = None, drop_last: bool = True
    ) -> None:
        self.dataset = None if isinstance(dataset, int) else dataset
        self.num_items = dataset if isinstance(dataset, int) else len(dataset)
        if self.num_items <= 0:
            raise ValueError("PromptCursor needs a non-empty dataset")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._seed_given = seed is not None
        # No seed (verl's data.seed=null): draw one, and keep it in state_dict so a resume matches.
        self.seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
        self.epoch = 0
        self.position = 0  # index into epoch_order(epoch) of the next item to hand out
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    @classmethod
    def from_config(cls, data_cfg: Any, dataset: Sized | int, *, drop_last: bool = True) -> PromptCursor:
        """Reads verl's ``data.shuffle`` and ``data.seed``."""
        return cls(
            dataset,
            shuffle=bool(_cfg_get(data_cfg, "shuffle", True)),
            seed=_cfg_get(data_cfg, "seed"),
            drop_last=drop_last,
        )

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order epoch ``epoch`` visits the dataset in."""
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def _current_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self.epoch_order(self.epoch), self.epoch
        assert self._order is not None
        return self._order

    def batches_per_epoch(self, batch_size: int) -> int:
        """verl's ``len(train_dataloader)``: steps in one pass over the data."""
        if self.drop_last:
            return self.num_items // batch_size
        return math.ceil(self.num_items / batch_size)

    def epoch_of_next(self, batch_size: int) -> int:
        """The epoch the next ``batch_size`` items start in (verl's ``training/epoch`` of that batch):
        the next one when drop_last skips this epoch's short tail."""
        skip = self.drop_last and self.num_items - self.position < batch_size
        return self.epoch + int(skip)

    def next_indices(self, batch_size: int) -> list[int]:
        """The next ``batch_size`` dataset indices; advances the cursor."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if self.drop_last and batch_size > self.num_items:
            raise ValueError(
                f"batch_size {batch_size} is larger than the dataset ({self.num_items} prompts) and drop_last "
                "is set, so no batch could ever be made"
            )
        if self.drop_last and self.num_items - self.position < batch_size:
            self.epoch, self.position = self.epoch + 1, 0  # skip the short tail, as verl's dataloader does
        out: list[int] = []
        while len(out) < batch_size:
            take = min(batch_size - len(out), self.num_items - self.position)
            out.extend(int(i) for i in self._current_order()[self.position : self.position + take])
            self.position += take
            if self.position == self.num_items:  # keep the cursor pointing at the next item to hand out
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def next_batch(self, batch_size: int) -> list[PromptItem]:
        """The next ``batch_size`` items of the dataset the sampler was built with."""
        if self.dataset is None:
            raise TypeError("this sampler was built from a length, not a dataset; use next_indices")
        return [self.dataset[i] for i in self.next_indices(batch_size)]  # type: ignore[index]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": self.num_items,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor. Refuses a state from a different dataset size or shuffle setting, or
        from a different explicit seed: resuming would silently give a different order."""
        if int(state["num_items"]) != self.num_items:
            raise ValueError(
                f"checkpointed cursor is for {state['num_items']} prompts, this dataset has {self.num_items}"
            )
        if bool(state["shuffle"]) != self.shuffle:
            raise ValueError(
                f"checkpointed cursor has shuffle={state['shuffle']}, this sampler {self.shuffle}"
            )
        if self._seed_given and int(state["seed"]) != self.seed:
            raise ValueError(f"checkpointed cursor has seed={state['seed']}, this sampler seed={self.seed}")
        position = int(state["position"])
        if not 0 <= position < self.num_items:
            raise ValueError(f"checkpointed cursor position {position} is outside [0, {self.num_items})")
        self.seed = int(state["seed"])
        self.epoch, self.position = int(state["epoch"]), position
        self.drop_last = bool(state.get("drop_last", self.drop_last))
        self._order_epoch = -1


def iter_batches(dataset: Sequence[PromptItem], batch_size: int | None = None) -> Iterator[list[PromptItem]]:
    """Validation batches: the dataset in order, no shuffle, the last batch possibly smaller.
    ``batch_size=None`` (verl's val_batch_size=null) gives the whole set as one batch."""
    n = len(dataset)
    size = n if batch_size is None else batch_size
    if size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    for start in range(0, n, size):
        yield [dataset[i] for i in range(start, min(start + size, n))]
