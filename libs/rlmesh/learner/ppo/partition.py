"""Deterministic split of a batch into mini-batches, data-parallel shards and micro-batches.

docs/design.md#learner-ranks"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "fixed_micro_batches",
    "mini_batches",
    "plan_micro_batches",
    "shard_rows",
    "token_balanced_micro_batches",
]


def mini_batches(rows: Sequence[int], mini_batch_size: int) -> list[list[int]]:
    """Consecutive chunks of ``mini_batch_size`` rows (the last may be smaller, like verl's split)."""
    if mini_batch_size <= 0:
        raise ValueError(f"mini_batch_size must be positive, got {mini_batch_size}")
    rows = list(rows)
    return [rows[i : i + mini_batch_size] for i in range(0, len(rows), mini_batch_size)]


def shard_rows(rows: Sequence[int], dp_size: int, seq_lens: Sequence[int] | None = None) -> list[list[int]]:
    """Shares for ``dp_size`` ranks; sizes differ by at most one, earlier ranks larger.

    Without ``seq_lens``: contiguous. With them (``trainer.balance_batch``, as verl's
    ``_balance_batch``): the same sizes, with the tokens spread evenly — rows longest first, each
    to the rank with the fewest tokens that still has room; each share keeps the rows' order.
    ``seq_lens`` is indexed by row.
    """
    rows = list(rows)
    base, extra = divmod(len(rows), dp_size)
    sizes = [base + (1 if r < extra else 0) for r in range(dp_size)]
    if seq_lens is None:
        shards, start = [], 0
        for size in sizes:
            shards.append(rows[start : start + size])
            start += size
        return shards
    position = {row: i for i, row in enumerate(rows)}
    balanced: list[list[int]] = [[] for _ in range(dp_size)]
    tokens = [0] * dp_size
    for row in sorted(rows, key=lambda r: (-seq_lens[r], position[r])):
        rank = min((r for r in range(dp_size) if len(balanced[r]) < sizes[r]), key=lambda r: (tokens[r], r))
        balanced[rank].append(row)
        tokens[rank] += seq_lens[row]
    return [sorted(share, key=position.__getitem__) for share in balanced]


def fixed_micro_batches(rows: Sequence[int], micro_batch_size: int | None) -> list[list[int]]:
    """Consecutive micro-batches of ``micro_batch_size`` rows (None = all rows in one)."""
    rows = list(rows)
    if not rows:
        return []
    if micro_batch_size is None:
        return [rows]
    return mini_batches(rows, micro_batch_size)


def token_balanced_micro_batches(
    rows: Sequence[int], seq_lens: Sequence[int], max_token_len: int, min_count: int = 1
) -> list[list[int]]:
    """Pack rows into as few micro-batches as hold at most ``max_token_len`` tokens each.

    Like verl's ``rearrange_micro_batches``: ``k = max(min_count, ceil(sum(len) / max_token_len))``
    (at most one per row) balanced partitions; here greedily (longest first into the lightest
    partition) and ``k`` grows until every partition fits the budget. Rows keep their order
    inside a micro-batch; micro-batches are ordered by their first row.

    Args:
        rows: row indices.
        seq_lens: ``seq_lens[i]`` is the token count (prompt + response) of ``rows[i]``.
        max_token_len: token budget of one micro-batch.
        min_count: at least this many micro-batches (capped at ``len(rows)``).

    Raises:
        ValueError: one sequence alone exceeds the budget.
    """
    rows = list(rows)
    n = len(rows)
    if n == 0:
        return []
    if len(seq_lens) != n:
        raise ValueError(f"{n} rows but {len(seq_lens)} sequence lengths")
    longest = max(seq_lens)
    if longest > max_token_len:
        raise ValueError(
            f"a sequence of {longest} tokens does not fit max_token_len={max_token_len} "
            "(ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu must hold one whole sequence)"
        )
    k = min(n, max(min_count, math.ceil(sum(seq_lens) / max_token_len)))
    order = sorted(range(n), key=lambda i: (-seq_lens[i], i))
    while True:
        loads = [0] * k
        members: list[list[int]] = [[] for _ in range(k)]
        for i in order:
            b = min(range(k), key=lambda j: (loads[j], j))
            loads[b] += seq_lens[i]
            members[b].append(i)
        if max(loads) <= max_token_len or k == n:
            break
        k += 1
    parts = sorted((sorted(m) for m in members), key=lambda m: m[0])
    return [[rows[i] for i in m] for m in parts]


def plan_micro_batches(
    rows: Sequence[int],
    dp_size: int,
    rank: int,
    *,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool = False,
    max_token_len: int | None = None,
    seq_lens: Sequence[int] | None = None,
    balance: bool = False,
) -> list[list[int]]:
    """This rank's micro-batches of ``rows``; as many on every rank (empty lists pad the short ones).

    Args:
        rows: the global (mini-)batch's row indices.
        dp_size, rank: the data-parallel group.
        micro_batch_size: rows per micro-batch (None = the whole shard) when not dynamic.
        use_dynamic_bsz: pack by tokens instead (needs ``max_token_len`` and ``seq_lens``).
        seq_lens: token count of every row of the batch, indexed by row.
        balance: spread the tokens evenly over the ranks (needs ``seq_lens``; see :func:`shard_rows`).
    """
    if balance and seq_lens is None:
        raise ValueError("balance needs seq_lens")
    shards = shard_rows(rows, dp_size, seq_lens if balance else None)

    def split(shard: list[int], min_count: int = 1) -> list[list[int]]:
        if use_dynamic_bsz:
            if max_token_len is None or seq_lens is None:
                raise ValueError("use_dynamic_bsz needs max_token_len and seq_lens")
            return token_balanced_micro_batches(shard, [seq_lens[r] for r in shard], max_token_len, min_count)
        return fixed_micro_batches(shard, micro_batch_size)

    count = max(len(split(shard)) for shard in shards)
    mine = split(shards[rank], count) if use_dynamic_bsz else split(shards[rank])
    return mine + [[] for _ in range(count - len(mine))]
