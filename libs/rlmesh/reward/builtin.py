"""The built-in rule rewards by name (gsm8k, math, math_dapo, arithmetic) and verl's choice among them
by ``data_source``, as in verl's ``default_compute_score`` (where ``math`` picks ``math_dapo``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlmesh.reward import arithmetic, gsm8k, math_dapo, math_reward


def _gsm8k(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    return gsm8k.compute_score(solution_str, ground_truth)


def _math(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    return math_reward.compute_score(solution_str, ground_truth)


def _math_dapo(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> dict:
    return math_dapo.compute_score(solution_str, ground_truth)


def _arithmetic(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> dict:
    return arithmetic.compute_score(solution_str, ground_truth)


# name -> function with verl's custom reward signature (data_source, solution_str, ground_truth, extra_info)
BUILTIN_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "gsm8k": _gsm8k,
    "math": _math,
    "math_dapo": _math_dapo,
    "arithmetic": _arithmetic,
}

# data_source -> built-in name (verl's default_compute_score for the rule rewards it ships)
DATA_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math_dapo",
    "math": "math_dapo",
    "math_dapo_reasoning": "math_dapo",
    "arithmetic": "arithmetic",
    "chain": "arithmetic",  # rlmesh.data.chain: the last running total after "####", an integer
}

# data_source prefix -> built-in name, for sources DATA_SOURCES does not name (verl: aime2024, ...)
DATA_SOURCE_PREFIXES: dict[str, str] = {"aime": "math_dapo"}


def builtin_for(data_source: str) -> str | None:
    """The built-in verl would pick for ``data_source``, or None."""
    name = DATA_SOURCES.get(data_source)
    if name is None:
        name = next((n for prefix, n in DATA_SOURCE_PREFIXES.items() if data_source.startswith(prefix)), None)
    return name


def data_source_rules() -> list[str]:
    """``data_source=built-in`` for each rule; a prefix rule reads ``aime*=math_dapo``."""
    exact = [f"{source}={name}" for source, name in DATA_SOURCES.items()]
    return exact + [f"{prefix}*={name}" for prefix, name in DATA_SOURCE_PREFIXES.items()]


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any
) -> float | dict[str, Any]:
    """verl's ``default_compute_score`` over the built-ins: a float, or a dict with a ``score`` key."""
    name = builtin_for(data_source)
    if name is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r}; known: "
            + ", ".join([*sorted(DATA_SOURCES), *(f"{prefix}*" for prefix in DATA_SOURCE_PREFIXES)])
        )
    return BUILTIN_FUNCTIONS[name](data_source, solution_str, ground_truth, extra_info)
