"""MATH (Hendrycks) rule reward, with the semantics of verl's ``verl/utils/reward_score/math_reward.py``.

docs/internals.md#rlmeshrewardmath_reward"""

from __future__ import annotations


def compute_score(solution_str: str, ground_truth: str) -> float:
    try:
        boxed = last_boxed_only_string(solution_str)
        if boxed is not None and is_equiv(remove_boxed(boxed), ground_truth):
            return 1.0
    except Exception:  # a malformed box is a wrong answer, never a crash
        return 0.0
    return 0.0


def is_equiv(str1: str | None, str2: str | None) -> bool:
    if str1 is None and str2 is None:
        return True
    if str1 is None or str2 is None:
        return False
    try:
        return strip_string(str1) == strip_string(str2)
    except Exception:
        return str1 == str2


def remove_boxed(s: str, *, braced_only: bool = False) -> str:
    """``\\boxed{x}`` → ``x`` and, unless ``braced_only``, ``\\boxed x`` → ``x``; anything else is an
    error. ``braced_only``: DAPO's form (verl's ``math_dapo.py``), where only ``\\boxed{x}`` is a box."""
    if not braced_only and "\\boxed " in s:
        prefix = "\\boxed "
        if not s.startswith(prefix):
            raise ValueError(f"not a boxed answer: {s!r}")
        return s[len(prefix) :]
    prefix = "\\boxed{"
    if not s.startswith(prefix) or not s.endswith("}"):
        raise ValueError(f"not a boxed answer: {s!r}")
    return s[len(prefix) : -1]


def last_boxed_only_string(string: str, *, braced_only: bool = False) -> str | None:
    """The last ``\\boxed{...}`` (braces balanced) or ``\\fbox{...}``, or ``\\boxed x`` up to a ``$``
    (Hendrycks MATH's forms). ``braced_only``: the last ``\\boxed{...}`` and nothing else (DAPO's)."""
    if braced_only:
        idx = string.rfind("\\boxed{")
    elif "\\boxed " in string:
        return "\\boxed " + string.split("\\boxed ")[-1].split("$")[0]
    else:
        idx = string.rfind("\\boxed")
        if idx < 0:
            idx = string.rfind("\\fbox")
    return balanced_from(string, idx) if idx >= 0 else None


def balanced_from(string: str, idx: int) -> str | None:
    """``string[idx:]`` up to the ``}`` that closes its first ``{``; None if it never closes."""
    depth = 0
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[idx : i + 1]
    return None


def _fix_fracs(string: str) -> str:
    parts = string.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part[0] == "{":  # an empty part raises, as in verl (is_equiv then compares raw strings)
            out += part
            continue
        if len(part) < 2:
            return string
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}{" + b + "}" + rest if b != "{" else "{" + a + "}" + b + rest
    return out


def _fix_a_slash_b(string: str) -> str:
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    if string != f"{a}/{b}":
        return string
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


def _remove_right_units(string: str) -> str:
    if "\\text{ " in string:
        parts = string.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError(f"more than one unit in {string!r}")
        return parts[0]
    return string


def _fix_sqrt(string: str) -> str:
    if "\\sqrt" not in string:
        return string
    parts = string.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        out += "\\sqrt" + part if part.startswith("{") else "\\sqrt{" + part[0] + "}" + part[1:]
    return out


def strip_string(string: str) -> str:
    """The lm-evaluation-harness MATH normalisation (see the module docstring)."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        string = string.replace(old, new)
    string = _remove_right_units(string)
    string = string.replace("\\\\%", "").replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        string = sides[1]
    string = _fix_sqrt(string)
    string = string.replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)
