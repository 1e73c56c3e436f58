"""ConfigError and the translation of pydantic's errors into one readable line per problem."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from rlmesh.config.base import CrossFieldProblems
from rlmesh.config.key_catalog import config_key, known_paths
from rlmesh.config.schema import RLMeshConfig
from rlmesh.config.secrets import SECRET_KEYS, redact_url


class ConfigError(ValueError):
    """An invalid configuration; `problems` lists every problem found, one sentence each.

    str() is one "- problem" line per problem, so callers can print it under a heading of their own.
    Cross-field rules (batch divisibility, …) are checked once every key is valid on its own.
    """

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(f"- {p}" for p in self.problems)


# Keys whose value an error never repeats: the token, and a Redis URL, whose password redact_url
# cannot find when it holds characters that should have been %-encoded (its own check masks it).
_UNSHOWN_KEYS = frozenset({*SECRET_KEYS, "rlmesh.redis_url"})


def _show(value: Any) -> str:
    """A value as the user typed it, YAML-ish and short (a URL's password masked)."""
    if isinstance(value, str):
        text = redact_url(repr(value))
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def suggest(key: str) -> list[str]:
    """Valid keys close to an unknown one: same-section typos first, then the same name elsewhere."""
    paths = known_paths()
    parent, _, leaf = key.rpartition(".")
    # Compare names within the section: full paths share a long prefix, which makes anything look close.
    siblings = {p.rpartition(".")[2]: p for p in paths if p.rpartition(".")[0] == parent}
    close = [siblings[name] for name in difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.6)]
    if not close:
        close = [p for p in paths if p.rpartition(".")[2] == leaf][:3]
    if not close:
        close = difflib.get_close_matches(key, paths, n=3, cutoff=0.6)
    return close


def unknown_key_message(key: str) -> str:
    matches = suggest(key)
    if not matches:
        return f"unknown key '{key}'"
    message = f"unknown key '{key}'; did you mean '{matches[0]}'?"
    if len(matches) > 1:
        message += " (also close: " + ", ".join(f"'{m}'" for m in matches[1:]) + ")"
    return message


def _path(loc: tuple[Any, ...]) -> tuple[str, bool]:
    """Dotted key of an error location, and whether its last part is a key the model does not have.

    pydantic puts union-branch tags (`str`, `list[str]`) in locations; walking the model classes
    tells a field name from such a tag.
    """
    model: type[BaseModel] | None = RLMeshConfig
    parts: list[str] = []
    unknown = False
    for item in loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        if model is None:
            continue  # a union tag below a leaf
        fields = model.model_fields
        name = next((n for n, f in fields.items() if n == item or item in _alias_names(f)), None)
        parts.append(str(item))
        if name is None:
            unknown = True
            model = None
            continue
        ann = fields[name].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return ".".join(parts), unknown


def _alias_names(field: Any) -> tuple[str, ...]:
    alias = field.validation_alias
    choices = getattr(alias, "choices", None)
    return tuple(c for c in choices or () if isinstance(c, str))


_YAML_WORDS = {"True": "true", "False": "false", "None": "null"}

_KIND = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "list": "a list",
    "dict": "a mapping",
    "model": "a mapping (a config section)",
    "tuple": "a list",
}


def _expected(error: dict[str, Any]) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "literal_error":
        allowed = str(ctx.get("expected", "")).replace(" or ", ", ")
        # pydantic writes Python literals; users write YAML
        return "allowed: " + re.sub(r"\b(True|False|None)\b", lambda m: _YAML_WORDS[m.group(1)], allowed)
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(v for k, v in ctx.items() if k in ("gt", "ge", "lt", "le"))
        return f"must be {bounds[kind]} {limit}"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    if kind in ("too_short", "too_long"):
        return f"expected {ctx.get('min_length', ctx.get('max_length'))} items"
    if kind == "int_from_float":
        return "expected an integer"
    for prefix, text in _KIND.items():
        if kind.startswith(prefix):
            return f"expected {text}"
    return error["msg"]


def _bad_value(key: str, errors: list[dict[str, Any]]) -> str:
    given = errors[0].get("input")
    if len(errors) == 1 and errors[0]["type"] == "value_error" and isinstance(given, dict):
        return f"'{key}': {_expected(errors[0])}"  # a rule about a whole section: its dump would be noise
    if key in _UNSHOWN_KEYS:
        if len(errors) == 1 and errors[0]["type"] == "value_error":
            return f"bad value for '{key}': {_expected(errors[0])}"  # the check shows what is safe
        value = "(not shown: it may hold a secret)"
    else:
        value = _show(given)
    if len(errors) == 1:
        return f"bad value for '{key}': {value}; {_expected(errors[0])}"
    # Several errors on one key come from union branches: say what the key accepts as a whole.
    leaf = config_key(key.split("[")[0])
    allowed = leaf.type if leaf else " or ".join(sorted({_expected(e) for e in errors}))
    return f"bad value for '{key}': {value}; expected {allowed}"


def _short_tuple(key: str, given: Any) -> str:
    leaf = config_key(key)
    return f"bad value for '{key}': {_show(given)}; expected {leaf.type if leaf else 'more items'}"


def format_validation_error(exc: ValidationError) -> list[str]:
    """One sentence per problem, naming the full dotted key, the value given and what is allowed."""
    problems: list[str] = []
    grouped: dict[str, list[dict[str, Any]]] = {}
    for error in exc.errors():
        cross = (error.get("ctx") or {}).get("error")
        if isinstance(cross, CrossFieldProblems):
            problems.extend(cross.problems)
            continue
        key, unknown = _path(tuple(error["loc"]))
        if error["type"] == "extra_forbidden" or unknown:
            problems.append(unknown_key_message(key))
        elif error["type"] == "missing" and isinstance(error["loc"][-1], int):
            problems.append(_short_tuple(key.rpartition("[")[0], error.get("input")))
        elif error["type"] == "missing":
            problems.append(f"missing required key '{key}'")
        else:
            grouped.setdefault(key or "<root>", []).append(error)
    problems.extend(_bad_value(key, errors) for key, errors in grouped.items())
    return problems
