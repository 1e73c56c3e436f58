"""verl's reward managers, applied by the reward service to what a reward function returned: ``naive``
takes its score as is; ``dapo`` records ``acc`` (a plain number) or the dict's every key among the
extras and adds DAPO's overlong penalty. docs/algorithms.md#dapo"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlmesh.reward.function_loader import RewardFunctionLoadError

if TYPE_CHECKING:
    from rlmesh.config import RLMeshConfig


def overlong_reward(
    valid_response_length: int, max_resp_len: int, overlong_buffer_len: int, penalty_factor: float
) -> float:
    """DAPO's overlong reward shaping (verl's ``DAPORewardManager``): zero up to
    ``max_resp_len - overlong_buffer_len`` tokens, then falling linearly to ``-penalty_factor`` at
    ``max_resp_len``::

        expected_len = max_resp_len - overlong_buffer_len
        overlong_reward = min(-(valid_response_length - expected_len) / overlong_buffer_len * penalty_factor, 0)
    """
    exceed_len = valid_response_length - (max_resp_len - overlong_buffer_len)
    return min(-exceed_len / overlong_buffer_len * penalty_factor, 0.0)


@dataclass(frozen=True)
class OverlongPenalty:
    max_resp_len: int
    buffer_len: int
    penalty_factor: float
    log: bool  # overlong_reward and overlong among the extras

    def __call__(self, valid_response_length: int) -> float:
        return overlong_reward(valid_response_length, self.max_resp_len, self.buffer_len, self.penalty_factor)


@dataclass(frozen=True)
class RewardManager:
    """``reward_model.reward_manager``: how a function's value becomes a sample's score and extras."""

    name: str = "naive"
    overlong: OverlongPenalty | None = None  # dapo only

    def shape(
        self, value: Any, score: float, extra: dict[str, float], valid_response_length: int
    ) -> tuple[float, dict[str, float]]:
        """(score, extras) for a function's ``value``, already read as ``score`` and numeric ``extra``.
        ``valid_response_length``: the response's tokens, its end-of-sequence token included."""
        if self.name != "dapo":
            return score, extra
        extra = dict(extra)
        if isinstance(value, Mapping):
            extra["score"] = score  # verl keeps each key of the dict, the score too
        else:
            extra["acc"] = score
        if self.overlong is not None:
            penalty = self.overlong(valid_response_length)
            score += penalty
            if self.overlong.log:
                extra["overlong_reward"] = penalty
                extra["overlong"] = float(penalty < 0)
        return score, extra


def reward_manager_from_config(cfg: RLMeshConfig) -> RewardManager:
    """From ``reward_model.*``: the manager, with the overlong penalty when it is enabled. Raises
    ``RewardFunctionLoadError`` when the buffer is longer than the response limit."""
    section = cfg.reward_model
    name = section.reward_manager or "naive"
    buffer = section.overlong()
    if name != "dapo" or not buffer.enable:
        return RewardManager(name)
    # verl's DAPO recipe counts from data.max_response_length; its main trainer from reward_kwargs.
    limit = section.reward_kwargs.max_resp_len or cfg.data.max_response_length
    if limit < buffer.len:
        raise RewardFunctionLoadError(
            f"the overlong buffer's len ({buffer.len}) must not exceed the response limit it counts back "
            f"from ({limit}: reward_model.reward_kwargs.max_resp_len, else data.max_response_length)"
        )
    return RewardManager(name, OverlongPenalty(limit, buffer.len, float(buffer.penalty_factor), buffer.log))
