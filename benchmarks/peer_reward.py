"""make bench-peer's reward, the one rule both sides score with: the response's text (special tokens
dropped, so generation ends at eos) must be exactly the sum the prompt ``a+b=`` asks for.

rlmesh loads this file as its custom reward function (``custom_reward_function.path``, verl's
``compute_score`` signature); benchmarks/peer_trl.py imports ``score_answer`` from it for TRL's
reward and for greedy accuracy. Standard library only: it runs in both venvs.
"""

from __future__ import annotations

from typing import Any


def score_answer(response_text: str, ground_truth: Any) -> float:
    """1.0 when the response is the ground truth, digit for digit (surrounding spaces ignored)."""
    return 1.0 if response_text.strip() == str(ground_truth).strip() else 0.0


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **_: Any
) -> float:
    return score_answer(solution_str, ground_truth)
