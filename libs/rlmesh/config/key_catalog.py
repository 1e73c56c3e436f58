"""Introspection of the config tree: every dotted key with its type, default and description."""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import AliasChoices, BaseModel, SecretStr
from pydantic.fields import FieldInfo

from rlmesh.config.base import COMPAT_DESCRIPTION
from rlmesh.config.schema import RLMeshConfig


@dataclass(frozen=True)
class ConfigKey:
    """One leaf of the tree, e.g. `actor_rollout_ref.actor.clip_ratio`."""

    key: str
    type: str
    default: Any
    description: str
    compat: bool = False
    aliases: tuple[str, ...] = ()


def _literal_str(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, bool) else repr(value)


def type_str(annotation: Any) -> str:
    """A short human-readable form of a field annotation: `int | null`, `'fixed' | 'adaptive'`, …"""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if annotation is Any:
        return "any"
    if annotation is type(None):
        return "null"
    if annotation is SecretStr:
        return "str"  # what the user writes, in docs/config.md and in "expected ..." messages
    if origin is Annotated:
        return type_str(args[0])
    if origin is Literal:
        return " | ".join(_literal_str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_str(a) for a in args)
    if origin is list:
        return f"list[{type_str(args[0])}]"
    if origin is tuple:
        return "[" + ", ".join(type_str(a) for a in args) + "]"
    if origin is dict:
        return "dict"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _bounds(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(meta, getattr(annotated_types, attr.capitalize())):
                parts.append(f"{op} {getattr(meta, attr)}")
    return ", ".join(parts)


def _aliases(field: FieldInfo, name: str) -> tuple[str, ...]:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return tuple(str(a) for a in alias.choices if isinstance(a, str) and a != name)
    return ()


def _section_type(field: FieldInfo) -> type[BaseModel] | None:
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _walk(model: BaseModel, prefix: str) -> Iterator[ConfigKey | str]:
    """Yields section paths (str) and leaves (ConfigKey), depth first, in declaration order."""
    for name, field in type(model).model_fields.items():
        key = f"{prefix}{name}"
        value = getattr(model, name)
        if _section_type(field) is not None:
            yield key
            yield from _walk(value, f"{key}.")
            continue
        bounds = _bounds(field)
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        yield ConfigKey(
            key=key,
            type=type_str(field.annotation) + (f" ({bounds})" if bounds else ""),
            default=list(value) if isinstance(value, tuple) else value,
            description=field.description or "",
            compat=bool(extra.get("compat")),
            aliases=_aliases(field, name),
        )


@functools.cache
def _all_keys() -> tuple[tuple[ConfigKey, ...], tuple[str, ...]]:
    # model_construct skips the root validator: derived keys keep their null defaults, which is
    # what a user who leaves them out gets.
    items = list(_walk(RLMeshConfig.model_construct(), ""))
    leaves = tuple(i for i in items if isinstance(i, ConfigKey))
    sections = tuple(i for i in items if isinstance(i, str))
    return leaves, sections


def config_keys() -> list[ConfigKey]:
    """Every leaf key of the tree with its type, default and description."""
    return list(_all_keys()[0])


def config_key(key: str) -> ConfigKey | None:
    """The leaf with this dotted key (an alias also finds it), or None."""
    for item in _all_keys()[0]:
        parent = item.key.rpartition(".")[0]
        if item.key == key or any(f"{parent}.{a}" == key for a in item.aliases):
            return item
    return None


def known_paths() -> list[str]:
    """Every valid dotted path: sections, leaves and aliases (candidates for did-you-mean)."""
    leaves, sections = _all_keys()
    paths = list(sections)
    for item in leaves:
        paths.append(item.key)
        parent = item.key.rpartition(".")[0]
        paths.extend(f"{parent}.{a}" for a in item.aliases)
    return paths


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default_cell(value: Any) -> str:
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def keys_markdown_table(include_compat: bool = True) -> str:
    """Markdown for docs/config.md: a table of every key with type, default and description, then a
    second table of the verl keys that load but do nothing, each with the reason
    (:mod:`rlmesh.config.ignored`).
    """
    from rlmesh.config.ignored import ignored_reason

    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    compat = []
    for item in config_keys():
        if item.compat:
            why = ignored_reason(item.key) or ""
            compat.append(f"| `{item.key}` | {_cell(_default_cell(item.default))} | {_cell(why)} |")
            continue
        lines.append(
            f"| `{item.key}` | {_cell(item.type)} | {_cell(_default_cell(item.default))} | {_cell(item.description)} |"
        )
    if include_compat and compat:
        lines += [
            "",
            "## Keys rlmesh ignores",
            "",
            f"verl keys that are {COMPAT_DESCRIPTION}. A config that sets any of them is told which, "
            "with the reason, in one warning at start-up (and by `rlmesh config validate`):",
            "",
            "| key | default | why rlmesh ignores it |",
            "|---|---|---|",
            *compat,
        ]
    return "\n".join(lines) + "\n"
