"""Reward of the synthetic arithmetic task (``rlmesh.data.arithmetic``, data_source ``arithmetic``).

docs/internals.md#rlmeshrewardarithmetic"""

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
