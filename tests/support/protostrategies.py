"""Hypothesis strategies for protobuf messages, built from their descriptors: every field gets
values of its type, edge values included (negative, huge, empty, unicode, NaN), and fields may be
left unset. ``bounds`` narrows an integer field where an accepted value would cost real work (a
generation's ``n`` or ``max_new_tokens``), always keeping values past every cap in the mix."""

from __future__ import annotations

import os
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# `make test`: the same 20 examples per property on every run (main stays green on a fixed
# sample); `make fuzz` (FUZZ_EXAMPLES=1000): many more, drawn at random.
_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=_EXAMPLES or 20,
    derandomize=not _EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: INT32,
    FieldDescriptor.TYPE_SINT32: INT32,
    FieldDescriptor.TYPE_SFIXED32: INT32,
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: INT64,
    FieldDescriptor.TYPE_SINT64: INT64,
    FieldDescriptor.TYPE_SFIXED64: INT64,
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor, bounds: dict[str, tuple[int, int]]) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        if field.name in bounds:
            small_lo, small_hi = bounds[field.name]
            return st.one_of(st.integers(small_lo, small_hi), st.sampled_from([lo, hi, small_hi * 1000]))
        return st.integers(lo, hi)
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(
            allow_nan=True, allow_infinity=True, width=32 if t == FieldDescriptor.TYPE_FLOAT else 64
        )
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=40)
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [999])
    raise TypeError(f"no strategy for {field.full_name} (type {t})")


def message_dicts(
    descriptor: Descriptor,
    bounds: dict[str, tuple[int, int]] | None = None,
    depth: int = 3,
    nonempty: frozenset[str] = frozenset(),
) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts of field name -> value (nested messages as dicts), for :func:`build`. Repeated
    fields named in ``nonempty`` are always present and hold at least one item."""
    bounds = bounds or {}
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth == 0:
                continue
            value = message_dicts(field.message_type, bounds, depth - 1, nonempty)
        else:
            value = _scalar(field, bounds)
        if field.is_repeated:
            value = st.lists(value, min_size=1 if field.name in nonempty else 0, max_size=5)
        fields[field.name] = value
    required = {name: fields.pop(name) for name in nonempty & fields.keys()}
    return st.fixed_dictionaries(required, optional=fields)


def build(cls: type, values: dict[str, Any]) -> Any:
    """``cls`` filled from a :func:`message_dicts` draw."""
    message = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = message_class(field)
            if field.is_repeated:
                getattr(message, name).extend(build(sub, v) for v in value)
            else:
                getattr(message, name).CopyFrom(build(sub, value))
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


def message_class(field: FieldDescriptor) -> type:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(field.message_type)


def names_in(descriptor: Descriptor, depth: int = 4) -> set[str]:
    """Every message and field name reachable from ``descriptor``: what an error may name."""
    names = {descriptor.name, descriptor.full_name}
    for field in descriptor.fields:
        names.add(field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE and depth:
            names |= names_in(field.message_type, depth - 1)
    return names
