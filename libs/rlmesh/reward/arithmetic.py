"""Reward of the synthetic arithmetic task (``rlmesh.data.arithmetic``, data_source ``arithmetic``).

The answer is read as verl's strict GSM8K extraction reads it (the last ``#### <number>`` within the
last 300 characters, commas removed) and compared to the ground truth as an integer, so ``#### 033``
and ``#### 33`` both match ``33``. 1.0 when right, else 0.0; ``format`` tells whether an answer was
given at all.
"""

from __future__ import annotations

from typing import Any

from rlmesh.reward.gsm8k import extract_solution


def _as_int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def compute_score(solution_str: str, ground_truth: str | int) -> dict[str, Any]:
    answer = extract_solution(solution_str, method="strict")
    expected = ground_truth if isinstance(ground_truth, int) else _as_int(str(ground_truth))
    given = None if answer is None else _as_int(answer)
    correct = given is not None and expected is not None and given == expected
    return {"score": 1.0 if correct else 0.0, "acc": correct, "format": answer is not None}
