"""Dynamic micro-batching by tokens: pack samples so that each forward's size (rows x longest row,
or the real tokens of a packed forward) stays within a token budget."""

from __future__ import annotations

from collections.abc import Sequence


def token_budget_micro_batches(
    lengths: Sequence[int], max_tokens: int, max_samples: int | None = None, packed: bool = False
) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches, longest samples first.

    Every group satisfies ``len(group) * max(lengths[group]) <= max_tokens`` (with ``packed``,
    ``sum(lengths[group]) <= max_tokens``: a padding-free forward computes the real tokens only),
    and ``len(group) <= max_samples`` when given, except a single sample longer than the budget,
    which goes alone. Sorting by length first keeps similar lengths together, so little of a
    padded batch is padding.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    load = 0  # real tokens of current
    for i in order:
        if current:
            width = lengths[current[0]]  # descending order: a group's first sample is its longest
            full = max_samples is not None and len(current) >= max_samples
            size = load + lengths[i] if packed else width * (len(current) + 1)
            if full or size > max_tokens:
                batches.append(current)
                current, load = [], 0
        current.append(i)
        load += lengths[i]
    if current:
        batches.append(current)
    return batches


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Tokens the forwards of ``batches`` process, padding included."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
