"""A micro-batch packed padding-free (``data.use_sequence_packing`` / ``use_remove_padding``):
its sequences back to back in a few rows, per-sequence position ids, attention never crossing a
sequence. docs/internals.md#rlmeshlearnerppopacked_layout"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlmesh.algo.packing import pack_units, packed_cost, packing_plan

if TYPE_CHECKING:
    from rlmesh.learner.ppo.forward import MicroBatch

__all__ = ["PackedLayout", "packed_layout"]

# Weight of a token against an attended pair when the model's shape is unknown: count tokens.
_UNKNOWN_TOKEN_COST = 1e6


@dataclass
class PackedLayout:
    """A micro-batch of ``n`` rows in ``G`` packed rows of width ``L``.

    ``input_ids``/``position_ids`` ``(G, L)``; ``attention_mask`` ``(G, 1, L, L)`` bool (True:
    attend); ``row`` ``(n,)`` the packed row of each micro-batch row; ``before`` ``(n, w)`` the
    column whose output scores each response token: the one before it, the last prompt column for
    the first token (and, as a placeholder, past the response); ``shared``: whether the samples of
    one prompt share its tokens (one unit per distinct prompt) or each sequence is its own unit.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    row: torch.Tensor
    before: torch.Tensor
    shared: bool

    def kept_columns(self) -> torch.Tensor:
        """The sorted columns some response token is scored by (``logits_to_keep``): the LM head
        runs on these only, not on the prompts."""
        return torch.unique(self.before)


def _prompt_groups(mb: MicroBatch, p: int) -> list[list[int]]:
    """Rows of ``mb`` grouped by equal prompt columns (tokens and padding), in first-seen order."""
    prompt = torch.cat([mb.input_ids[:, :p], mb.attention_mask[:, :p].to(mb.input_ids.dtype)], dim=1)
    inverse = torch.unique(prompt, dim=0, return_inverse=True)[1].tolist()
    groups: dict[int, list[int]] = {}
    for r, u in enumerate(inverse):
        groups.setdefault(u, []).append(r)
    return list(groups.values())


def packed_layout(mb: MicroBatch, token_cost: float | None, share_prompts: bool = True) -> PackedLayout:
    """``mb`` packed (:func:`rlmesh.algo.packing.pack_units`), each sequence's tokens without its
    padding and with its own position ids (those of the padded layout, which start at 0 on its
    first real token), in rows no longer than the longest unit.

    Units: one per sequence (its prompt, then its response); with ``share_prompts``, when it costs
    less by :func:`rlmesh.algo.packing.packed_cost`, one per distinct prompt (the prompt once, then
    each of its samples' responses, each seeing the prompt and itself only). Every output equals
    the padded layout's up to float summation order.
    """
    n, length = mb.input_ids.shape
    w = mb.response_width
    p = length - w
    real = mb.attention_mask.bool()
    prompt_len, response_len = real[:, :p].sum(dim=1), real[:, p:].sum(dim=1)
    # Pieces 0..n-1: each row's prompt tokens; n..2n-1: its response tokens (row-major order).
    ids = torch.cat([mb.input_ids[:, :p][real[:, :p]], mb.input_ids[:, p:][real[:, p:]]])
    positions = torch.cat([mb.position_ids[:, :p][real[:, :p]], mb.position_ids[:, p:][real[:, p:]]])
    piece_lengths = prompt_len.tolist() + response_len.tolist()

    candidates = [[[r, n + r] for r in range(n)]]
    if share_prompts and n > 1 and p > 0:
        groups = _prompt_groups(mb, p)
        if len(groups) < n:
            candidates.append([[rows[0], *(n + r for r in rows)] for rows in groups])
    tc = _UNKNOWN_TOKEN_COST if token_cost is None else token_cost
    best = None
    for units in candidates:
        plan, width = packing_plan([sum(piece_lengths[i] for i in unit) for unit in units])
        cost = packed_cost(len(plan), width, tc)
        if best is None or cost < best[0]:
            best = (cost, units, plan)
    assert best is not None
    _, units, plan = best
    packed = pack_units(ids, positions, piece_lengths, units, rows=plan)

    device = mb.input_ids.device
    prefix = torch.empty(n, dtype=torch.long, device=device)  # the prompt piece each row's response follows
    for unit in units:
        prefix[torch.tensor(unit[1:], device=device) - n] = unit[0]
    last_prompt = (packed.start[prefix] + prompt_len[prefix] - 1).clamp(min=0)
    response_start = packed.start[n:]
    j = torch.arange(w, device=device)
    scored = (j[None, :] >= 1) & (j[None, :] < response_len[:, None])
    before = torch.where(scored, response_start[:, None] + j[None, :] - 1, last_prompt[:, None])
    return PackedLayout(
        packed.input_ids,
        packed.attention_mask,
        packed.position_ids,
        packed.row[n:],
        before,
        shared=len(units) < n,
    )
