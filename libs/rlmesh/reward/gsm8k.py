"""GSM8K rule reward, scored exactly as verl's ``verl/utils/reward_score/gsm8k.py``.

docs/internals.md#rlmeshrewardgsm8k"""

from __future__ import annotations

import re

SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
_INVALID_FLEXIBLE = ("", ".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer a response gives, or None when it gives none (see the module docstring)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:] if len(solution_str) > SOLUTION_CLIP_CHARS else solution_str
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    candidates = _FLEXIBLE.findall(tail)
    if not candidates:
        return None
    for candidate in reversed(candidates):
        if candidate not in _INVALID_FLEXIBLE:
            return candidate
    # verl's loop leaves its variable on the first candidate when every one is invalid.
    return candidates[0]


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for an exact match, ``format_score`` for a wrong answer, 0 for no answer."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)
