"""A sample whose reward failed: the score training and validation give it (``rlmesh.reward.on_error``),
the count per step, and when failures stop the run. docs/train.md#when-the-reward-fails"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlmesh.v1 import common_pb2, trajectory_pb2

if TYPE_CHECKING:
    from rlmesh.config import RLMeshConfig

Trajectory = trajectory_pb2.Trajectory

# How a rollout replica marks a sample whose task's greedy baseline (ReMax) could not be scored
# (rlmesh.rollout.sampler.set_baseline): the sample's own score is fine, its baseline is not.
BASELINE_FAILED = "greedy baseline: "
# The stop message quotes this much of the first failure: its headline and frames, not a novel.
MAX_QUOTED_CHARS = 3000


class RewardFailed(RuntimeError):
    """Too many samples of a step or of a validation failed to score: the run stops. The message
    quotes the first failure, with the user's file and line."""


def is_reward_failure(error: common_pb2.SampleError) -> bool:
    """Whether ``error`` is set by the reward service (source ``reward:<function>``): a reference or
    replica failure is no reward's and keeps the sample out of training whatever the rule."""
    return (error.code != 0 or bool(error.message)) and error.source.split(":", 1)[0] == "reward"


@dataclass
class FailureTally:
    """Samples scored (or tried) and how many of them failed; the first failure's text."""

    samples: int = 0
    failed: int = 0
    first: str = ""

    def add(self, failure: str | None) -> None:
        """Counts a sample; ``failure`` is its reward's error message, None when it scored."""
        self.samples += 1
        if failure is not None:
            self.failed += 1
            self.first = self.first or failure or "(no message)"

    @property
    def ratio(self) -> float:
        return self.failed / self.samples if self.samples else 0.0

    def metrics(self, prefix: str) -> dict[str, float]:
        """``<prefix>/failed`` (samples) and ``<prefix>/failed_ratio`` (of the samples counted)."""
        return {f"{prefix}/failed": float(self.failed), f"{prefix}/failed_ratio": self.ratio}

    def summary(self) -> str:
        return f"the reward failed on {self.failed} of {self.samples} samples ({self.ratio:.0%})"


@dataclass(frozen=True)
class RewardErrorRule:
    """``rlmesh.reward.on_error``, ``error_score`` and ``max_failed_ratio``; ``needs_baseline``: the run
    trains with greedy baselines (ReMax), which a penalised sample then needs too."""

    on_error: Literal["penalty", "drop"] = "penalty"
    error_score: float = 0.0
    max_failed_ratio: float = 0.5
    needs_baseline: bool = False

    @classmethod
    def from_config(cls, cfg: RLMeshConfig) -> RewardErrorRule:
        section = cfg.rlmesh.reward
        return cls(
            on_error=section.on_error,
            error_score=section.error_score,
            max_failed_ratio=section.max_failed_ratio,
            needs_baseline=cfg.algorithm.adv_estimator == "remax",
        )

    def apply(self, traj: Trajectory) -> Trajectory:
        """``traj`` as training takes it. Under ``penalty`` a sample whose reward failed is a copy
        scored ``error_score`` (its baseline instead when only its task's greedy baseline failed),
        its error cleared, so its prompt group keeps all its samples; otherwise ``traj`` itself
        (under ``drop`` the learner's checks then refuse it, as any sample with an error)."""
        if self.on_error != "penalty" or not is_reward_failure(traj.error):
            return traj
        out = Trajectory()
        out.CopyFrom(traj)
        out.ClearField("error")
        if traj.error.message.startswith(BASELINE_FAILED):
            out.baseline_score = self.error_score
            return out
        out.score = self.error_score
        # The replica records the sample's own failure only; its task's baseline may be missing
        # too, and ReMax trains no sample without one.
        if self.needs_baseline and not out.HasField("baseline_score"):
            out.baseline_score = self.error_score
        return out

    def validation_score(self, score: float, failed: bool) -> float | None:
        """A validation sample's score: ``error_score`` when its reward failed under ``penalty``,
        None (left out of the means) under ``drop``."""
        if not failed:
            return score
        return self.error_score if self.on_error == "penalty" else None

    def check(self, tally: FailureTally, where: str) -> None:
        """Raises ``RewardFailed`` when more than ``max_failed_ratio`` of ``tally``'s samples failed,
        or every one of them did (nothing is then left to learn from or to validate)."""
        if tally.failed == 0 or (tally.ratio <= self.max_failed_ratio and tally.failed < tally.samples):
            return
        why = (
            "every one of them"
            if tally.failed == tally.samples
            else f"more than rlmesh.reward.max_failed_ratio={self.max_failed_ratio:g} allows"
        )
        first = (
            tally.first if len(tally.first) <= MAX_QUOTED_CHARS else tally.first[:MAX_QUOTED_CHARS] + "..."
        )
        raise RewardFailed(
            f"{where}: {tally.summary()}, {why}; the run stops. The first failure:\n"
            f"{textwrap.indent(first, '  ')}\n"
            "Fix the reward function and run the same command again: it resumes from the last "
            "checkpoint. rlmesh.reward.on_error and rlmesh.reward.max_failed_ratio set what a failed "
            "reward costs (docs/train.md#when-the-reward-fails)."
        )

    def describe(self, tally: FailureTally) -> str:
        """What happened to the failed samples, for the learner's log."""
        fate = (
            f"scored {self.error_score:g} (rlmesh.reward.on_error=penalty)"
            if self.on_error == "penalty"
            else "left out (rlmesh.reward.on_error=drop)"
        )
        return f"{tally.summary()}: {fate}"


def step_line_part(metrics: Mapping[str, float]) -> str:
    """What ``rlmesh train``'s step line shows of a step's failed rewards: their share, when any."""
    failed = metrics.get("reward/failed", 0.0)
    if not failed:
        return ""
    return f"  reward failed {metrics.get('reward/failed_ratio', 0.0):.0%} ({failed:.0f})"
