"""Padding-free sequence packing: sequences back to back in a few rows, attention kept inside each.

docs/internals.md#rlmeshlearnerppopacked_layout"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PACKABLE_MODEL_TYPES",
    "PackedRows",
    "attention_mask_problem",
    "first_fit_decreasing",
    "pack_units",
    "packed_cost",
    "packing_plan",
]


# Decoders whose attention takes a custom 4D mask as is and whose layers are otherwise per token
# (RoPE from position_ids, no sliding window unless configured, which attention_mask_problem refuses).
PACKABLE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})


def attention_mask_problem(config: Any) -> str | None:
    """Why a transformers model of ``config`` (its ``PretrainedConfig``) cannot take a custom 4D
    boolean mask (:class:`PackedRows`), or None when it can: a plain causal decoder of
    :data:`PACKABLE_MODEL_TYPES` on ``sdpa`` attention without sliding windows (``eager`` would
    need an additive float mask, flash attention none at all)."""
    if config is None:
        return "the model has no transformers config"
    model_type = getattr(config, "model_type", None)
    if model_type not in PACKABLE_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(sorted(PACKABLE_MODEL_TYPES))}"
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        return f"the model's attention implementation is {impl!r}, not 'sdpa'"
    if not getattr(config, "is_causal", True):
        return "the model's attention is not causal"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if any(t != "full_attention" for t in layer_types):
            return "the model has sliding-window attention layers"
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "the model has sliding-window attention"
    return None


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins whose lengths sum to at most ``capacity``: longest first, each
    into the first bin with room (an item longer than ``capacity`` gets a bin of its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def packing_plan(unit_lengths: Sequence[int], capacity: int | None = None) -> tuple[list[list[int]], int]:
    """Rows of units (:func:`first_fit_decreasing`) and the packed width, the longest row.

    ``capacity`` defaults to the longest unit: a dense masked attention kernel computes every pair of
    a row, masked or not, so rows no longer than the longest sequence cost at most the padded
    layout's attention, while the per-token work shrinks to the real tokens (and a little
    fragmentation)."""
    if not unit_lengths:
        return [], 0
    cap = max(unit_lengths) if capacity is None else max(capacity, max(unit_lengths))
    rows = first_fit_decreasing(unit_lengths, cap)
    return rows, max(sum(unit_lengths[u] for u in row) for row in rows)


def packed_cost(rows: int, width: int, token_cost: float) -> float:
    """``rows * width * (token_cost + width)``: per-token work (projections, MLP; ``token_cost``
    in units of one attended query-key pair) plus every pair of each row, in attended pairs."""
    return float(rows) * width * (token_cost + width)


@dataclass
class PackedRows:
    """Units packed into rows, padded at the end of each row to the longest.

    ``input_ids``/``position_ids`` ``(rows, L)`` (padding: ``pad_id``, position 0);
    ``attention_mask`` ``(rows, 1, L, L)`` bool, True where query ``q`` (dim 2) attends to key
    ``k`` (dim 3); ``row``/``start`` ``(pieces,)``: the row and first column of each piece (-1 for
    a piece in no unit)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    row: torch.Tensor
    start: torch.Tensor


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    total = int(lengths.sum())
    first = torch.cumsum(lengths, 0) - lengths  # where each range begins in the output
    return torch.repeat_interleave(starts - first, lengths, output_size=total) + torch.arange(
        total, device=starts.device
    )


def pack_units(
    ids: torch.Tensor,
    positions: torch.Tensor,
    piece_lengths: Sequence[int],
    units: Sequence[Sequence[int]],
    rows: Sequence[Sequence[int]] | None = None,
    pad_id: int = 0,
) -> PackedRows:
    """Pack units of pieces into rows with a block-diagonal causal mask.

    A unit is a shared prefix and its continuations: ``units[u]`` lists piece indices, the prefix
    first (a prompt, then each sampled response of it; or a prompt and one response). A unit's
    pieces lie back to back in one row. Token ``q`` attends to token ``k`` iff both are in the same
    unit, ``k`` is in its prefix or in the same piece as ``q``, and ``k`` is not after ``q``:

    .. math:: M_{qk} = [u_k = u_q] \\wedge ([c_k = 0] \\vee [c_k = c_q]) \\wedge [k \\le q]

    (``c`` the piece's place in its unit), so no token ever sees another sequence, and a
    continuation sees its prefix as if it followed it alone. Padding queries attend to themselves
    (a finite softmax; no real token sees them).

    Args:
        ids, positions: ``(total,)`` the pieces' token ids and position ids back to back, piece
            ``i`` being ``piece_lengths[i]`` long.
        units: piece indices of each unit; a piece in no unit is left out.
        rows: units of each row (:func:`packing_plan`); default that plan at its default capacity.
    """
    device = ids.device
    unit_lengths = [sum(piece_lengths[i] for i in unit) for unit in units]
    if rows is None:
        rows, _ = packing_plan(unit_lengths)
    fills = [sum(unit_lengths[u] for u in row) for row in rows]
    width = max(fills, default=0)
    n_pieces = len(piece_lengths)
    piece_row, piece_start = [-1] * n_pieces, [-1] * n_pieces
    order, unit_of, part_of = [], [], []  # placed pieces in row order, with their unit and part
    for r, row in enumerate(rows):
        col = 0
        for u in row:
            for part, i in enumerate(units[u]):
                piece_row[i], piece_start[i] = r, col
                order.append(i)
                unit_of.append(u)
                part_of.append(part)
                col += piece_lengths[i]
    lengths_all = torch.tensor(list(piece_lengths), dtype=torch.long, device=device)
    offsets = torch.cumsum(lengths_all, 0) - lengths_all  # where each piece begins in ids
    placed = torch.tensor(order, dtype=torch.long, device=device)
    lengths = lengths_all[placed]
    src = _ranges(offsets[placed], lengths)
    dst_row = torch.repeat_interleave(
        torch.tensor(piece_row, dtype=torch.long, device=device)[placed], lengths
    )
    dst_col = _ranges(torch.tensor(piece_start, dtype=torch.long, device=device)[placed], lengths)

    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=ids.dtype, device=device)
    position_ids = torch.zeros(shape, dtype=positions.dtype, device=device)
    unit_id = torch.full(shape, -1, dtype=torch.long, device=device)
    part_id = torch.full(shape, -1, dtype=torch.long, device=device)
    input_ids[dst_row, dst_col] = ids[src]
    position_ids[dst_row, dst_col] = positions[src]
    unit_id[dst_row, dst_col] = torch.repeat_interleave(
        torch.tensor(unit_of, dtype=torch.long, device=device), lengths
    )
    part_id[dst_row, dst_col] = torch.repeat_interleave(
        torch.tensor(part_of, dtype=torch.long, device=device), lengths
    )

    col = torch.arange(width, device=device)
    key_unit, query_unit = unit_id[:, None, :], unit_id[:, :, None]
    key_part, query_part = part_id[:, None, :], part_id[:, :, None]
    mask = (key_unit == query_unit) & (key_unit >= 0) & ((key_part == 0) | (key_part == query_part))
    mask &= col[None, None, :] <= col[None, :, None]
    mask |= torch.eye(width, dtype=torch.bool, device=device)[None]
    return PackedRows(
        input_ids,
        position_ids,
        mask[:, None],
        torch.tensor(piece_row, dtype=torch.long, device=device),
        torch.tensor(piece_start, dtype=torch.long, device=device),
    )
