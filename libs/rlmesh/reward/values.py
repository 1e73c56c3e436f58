"""What a reward function returned, read as (score, extras): a number, or a dict with a ``score`` key."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from rlmesh.v1 import common_pb2

ErrorCode = common_pb2.ErrorCode


class NotAScore(ValueError):
    """The value is no usable score; ``code`` is NOT_A_NUMBER or NON_FINITE."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def as_float(value: Any) -> float | None:
    """A real number as float, else None (strings, None and containers are not numbers). numpy
    scalars and one-element arrays or tensors count, through their ``item()``."""
    if isinstance(value, bool | numbers.Real):
        try:
            return float(value)
        except (OverflowError, TypeError, ValueError):
            return None
    item = getattr(value, "item", None)
    if callable(item):
        try:
            inner = item()
        except Exception:
            return None
        if isinstance(inner, bool | numbers.Real):
            return as_float(inner)
    return None


# A reward's extra values travel with each sample and become metrics by name: at most this many,
# the first in sorted order, so a reward that returns a key per sample cannot make thousands of
# series (or bloat every trajectory).
MAX_REWARD_EXTRA_KEYS = 32


def read_score(value: Any, function: str) -> tuple[float, dict[str, float]]:
    """(score, numeric extras) of ``value``; raises ``NotAScore`` saying what is wrong with it."""
    extra: dict[str, float] = {}
    raw = value
    if isinstance(value, Mapping):
        if "score" not in value:
            keys = ", ".join(map(str, value)) or "none"
            raise NotAScore(
                ErrorCode.ERROR_CODE_NOT_A_NUMBER,
                f"reward function {function} returned a dict without a 'score' key (keys: {keys})",
            )
        raw = value["score"]
        for key in sorted((k for k in value if k != "score"), key=str):
            number = as_float(value[key])
            if number is not None:
                extra[str(key)] = number
                if len(extra) == MAX_REWARD_EXTRA_KEYS:
                    break
    score = as_float(raw)
    if score is None:
        raise NotAScore(
            ErrorCode.ERROR_CODE_NOT_A_NUMBER,
            f"reward function {function} returned {type(raw).__name__} {_short(raw)}, not a number",
        )
    if not math.isfinite(score):
        raise NotAScore(
            ErrorCode.ERROR_CODE_NON_FINITE, f"reward function {function} returned a non-finite score {score}"
        )
    return score, extra


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
