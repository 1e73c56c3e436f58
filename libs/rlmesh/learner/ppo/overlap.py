"""Independent phases of one learner step run side by side: the critic's update beside the actor's,
the reference and value forwards beside the actor's, as verl's split placement runs them on
separate devices. docs/throughput.md#the-learners-share"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Phase", "PhaseRunner"]


@dataclass(frozen=True)
class Phase:
    """What one phase returned, when it began (``time.time()``) and how long it ran (seconds)."""

    result: Any
    start: float
    seconds: float


def _timed(fn: Callable[[], Any], threads: int | None) -> Phase:
    if threads is not None:
        # Per calling thread: OpenMP's team size and MKL's are thread-local settings.
        torch.set_num_threads(threads)
    wall, t0 = time.time(), time.perf_counter()
    result = fn()
    return Phase(result, wall, time.perf_counter() - t0)


class PhaseRunner:
    """Runs a step's phases one after the other, or (``overlap``) each in its own thread with the
    process's torch threads shared out among them (at least one each).

    Overlap is only sound where the phases share no collective: the caller enables it for a group of
    one rank (several ranks would issue the actor's and the critic's all-reduces in an order that
    differs between ranks). Torch ops release the GIL, so two small models' updates, each too small
    to keep several cores busy with intra-op threads, proceed in parallel. These threads live inside
    one call on rank 0's trainer thread (``rlmesh.learner.run.trainer_thread``) and all end before
    it returns: no other trainer call overlaps them (docs/design.md#one-steps-concurrency).
    """

    # A step has at most three independent phases (reference, old log-probs, values).
    MAX_PHASES = 3

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self._pool: ThreadPoolExecutor | None = None

    def run(self, phases: Mapping[str, Callable[[], Any]]) -> dict[str, Phase]:
        """Each of ``phases`` (name → no-argument function), in order or side by side; returns
        name → :class:`Phase`. The first phase to raise is raised once all have ended."""
        if not self.overlap or len(phases) < 2:
            return {name: _timed(fn, None) for name, fn in phases.items()}
        if len(phases) > self.MAX_PHASES:
            raise ValueError(f"at most {self.MAX_PHASES} phases side by side, got {sorted(phases)}")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.MAX_PHASES, thread_name_prefix="learner-phase")
        total = torch.get_num_threads()
        share = max(1, total // len(phases))
        try:
            futures = {name: self._pool.submit(_timed, fn, share) for name, fn in phases.items()}
            out: dict[str, Phase] = {}
            error: BaseException | None = None
            for name, fut in futures.items():
                try:
                    out[name] = fut.result()
                except BaseException as e:  # re-raised below, once every phase ended
                    error = error or e
            if error is not None:
                raise error
            return out
        finally:
            torch.set_num_threads(total)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
