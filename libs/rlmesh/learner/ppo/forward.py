"""Forward passes of one micro-batch: per-token log-probs/entropies (actor) and values (critic).

docs/internals.md#rlmeshlearnerppoforward"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlmesh.algo import entropy_from_logits, logprobs_from_logits
from rlmesh.algo.packing import PACKABLE_MODEL_TYPES, attention_mask_problem
from rlmesh.learner.ppo.batch import PPOBatch
from rlmesh.learner.ppo.model_loading import hf_model
from rlmesh.learner.ppo.packed_layout import PackedLayout, packed_layout

__all__ = [
    "SHARED_PROMPT_MODEL_TYPES",
    "MicroBatch",
    "SharedPromptLayout",
    "actor_forward",
    "critic_forward",
    "greedy_generate",
    "packing_problem",
    "pad_to_width",
    "require_packable",
    "rows_of",
    "shared_prompt_layout",
    "slice_micro_batch",
    "token_cost_in_pairs",
]

# The decoders that take a custom 4D mask (shared prompts, packing): rlmesh.algo.packing.
SHARED_PROMPT_MODEL_TYPES = PACKABLE_MODEL_TYPES


@dataclass
class MicroBatch:
    """Rows of a batch, trimmed: ``input_ids``/``attention_mask``/``position_ids`` ``(n, L)``,
    ``responses`` ``(n, w)``; ``width`` is the batch's response width ``R`` to pad outputs to."""

    rows: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor
    width: int

    @property
    def response_width(self) -> int:
        return int(self.responses.shape[1])


def slice_micro_batch(batch: PPOBatch, rows: list[int], device: torch.device | str = "cpu") -> MicroBatch:
    """The rows ``rows`` of ``batch`` with all-padding edge columns dropped, on ``device``."""
    idx = torch.as_tensor(rows, dtype=torch.long)
    p = batch.prompt_length
    attention_mask = batch.attention_mask[idx]
    # Prompts are left-padded: row i's first real token sits at p - prompt_len_i.
    start = int((p - attention_mask[:, :p].sum(dim=1)).min())
    w = max(int(batch.response_mask[idx].sum(dim=1).max()), 1)
    cols = slice(start, p + w)
    return MicroBatch(
        rows=list(rows),
        input_ids=batch.input_ids[idx, cols].to(device),
        attention_mask=attention_mask[:, cols].to(device),
        position_ids=batch.position_ids[idx, cols].to(device),
        responses=batch.responses[idx, :w].to(device),
        width=batch.response_length,
    )


@dataclass
class SharedPromptLayout:
    """A micro-batch with every distinct prompt once: packed row ``g`` is a prompt followed by the
    real tokens of each of its samples' responses, one after the other, then padding to the longest
    packed row. Each response attends to its prompt and to itself only, so every output equals the
    one of the padded layout; the prompt's forward runs once instead of once per sample, and no
    column is spent on a response's padding.

    ``input_ids``/``position_ids`` ``(G, L)``; ``attention_mask`` ``(G, 1, L, L)`` bool (True:
    attend); ``group`` ``(n,)`` the packed row of each micro-batch row; ``columns`` ``(n, w)`` the
    packed column of each response token (-1 past the response); ``before`` ``(n, w)`` the column
    whose output scores each response token: the one before it, the last prompt column for the
    first token (and, as a placeholder, past the response); ``prompt_width`` ``P``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    group: torch.Tensor
    columns: torch.Tensor
    before: torch.Tensor
    prompt_width: int

    @property
    def kept_columns(self) -> int:
        """Output columns from the last prompt column to the end (``logits_to_keep``)."""
        return int(self.input_ids.shape[1]) - self.prompt_width + 1


def packing_problem(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot take a packed layout's custom 4D mask, or None when it can
    (:func:`rlmesh.algo.packing.attention_mask_problem` of its config).

    ``module`` is a DeepSpeed engine, a peft model or a transformers model.
    """
    inner = module.module if isinstance(getattr(module, "module", None), torch.nn.Module) else module
    return attention_mask_problem(getattr(hf_model(inner), "config", None))


def token_cost_in_pairs(module: torch.nn.Module) -> float | None:
    """FLOPs of one token through a layer's projections and MLP over those of one attended
    query-key pair, from the model's config; None when the model cannot share prompts or pack
    (:func:`packing_problem`).

    ``module`` is a DeepSpeed engine, a peft model or a transformers model.
    """
    if packing_problem(module) is not None:
        return None
    inner = module.module if isinstance(getattr(module, "module", None), torch.nn.Module) else module
    cfg = hf_model(inner).config
    try:
        h, heads, inter = int(cfg.hidden_size), int(cfg.num_attention_heads), int(cfg.intermediate_size)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or h // heads)
    except (AttributeError, TypeError, ValueError):
        return None
    per_token = 2 * (2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * inter)
    per_pair = 4 * heads * head_dim  # q.k and p.v, each a multiply-add per head dimension
    return per_token / per_pair


def shared_prompt_layout(mb: MicroBatch, token_cost: float | None) -> SharedPromptLayout | None:
    """The micro-batch with each distinct prompt once (see :class:`SharedPromptLayout`), or None
    when no two rows share a prompt, ``token_cost`` is None, or it would not cost less.

    Rows share a prompt when their prompt columns (tokens and padding) are equal; they need not be
    adjacent. Responses are right-padded (their real tokens first). The cost compared, in attended
    pairs, is ``rows * (L * token_cost + L^2)`` for each layout (a masked attention kernel computes
    masked pairs too), so many long responses under a short prompt keep the padded layout.
    """
    n, length = mb.input_ids.shape
    w = mb.response_width
    p = length - w
    if token_cost is None or n < 2 or p < 1:
        return None
    prompt = torch.cat([mb.input_ids[:, :p], mb.attention_mask[:, :p].to(mb.input_ids.dtype)], dim=1)
    inverse = torch.unique(prompt, dim=0, return_inverse=True)[1].tolist()
    lengths_t = mb.attention_mask[:, p:].sum(dim=1)
    index: dict[int, int] = {}
    group, slot, offset, first, ends = [], [], [], [], []
    for r, (u, n_tokens) in enumerate(zip(inverse, lengths_t.tolist(), strict=True)):
        g = index.setdefault(u, len(index))
        if g == len(first):
            first.append(r)
            ends.append([p, 0])  # next free column, samples placed
        group.append(g)
        offset.append(ends[g][0])
        slot.append(ends[g][1])
        ends[g][0] += n_tokens
        ends[g][1] += 1
    n_groups, packed = len(first), max(end for end, _ in ends)
    if n_groups == n or n_groups * packed * (token_cost + packed) >= n * length * (token_cost + length):
        return None

    device = mb.input_ids.device
    group_t = torch.tensor(group, device=device)
    first_t = torch.tensor(first, device=device)
    j = torch.arange(w, device=device)
    real = j[None, :] < lengths_t[:, None]  # (n, w): response tokens, not padding
    cols = torch.tensor(offset, device=device)[:, None] + j[None, :]
    dst = (group_t[:, None].expand(n, w)[real], cols[real])
    input_ids = mb.input_ids.new_zeros((n_groups, packed))
    position_ids = mb.position_ids.new_zeros((n_groups, packed))
    input_ids[:, :p] = mb.input_ids[first_t, :p]
    position_ids[:, :p] = mb.position_ids[first_t, :p]
    input_ids[dst] = mb.input_ids[:, p:][real]
    position_ids[dst] = mb.position_ids[:, p:][real]
    # Segment 0 is the prompt, s + 1 the s-th sample of the row, -1 padding: a query attends to the
    # real tokens of the prompt and of its own segment, up to itself.
    segment = torch.full((n_groups, packed), -1, dtype=torch.long, device=device)
    segment[:, :p] = torch.where(mb.attention_mask[first_t, :p].bool(), 0, -1)
    segment[dst] = (torch.tensor(slot, device=device)[:, None] + 1).expand(n, w)[real]
    pos = torch.arange(packed, device=device)
    keys, queries = segment[:, None, :], segment[:, :, None]
    mask = (keys >= 0) & ((keys == 0) | (keys == queries)) & (pos[None, None, :] <= pos[None, :, None])
    # Padding queries that would see no key attend to themselves: finite, and seen by no real token.
    mask |= torch.eye(packed, dtype=torch.bool, device=device)[None]
    before = torch.where(real & (j[None, :] > 0), cols - 1, p - 1)
    columns = torch.where(real, cols, -1)
    return SharedPromptLayout(input_ids, mask[:, None], position_ids, group_t, columns, before, p)


def rows_of(t: torch.Tensor, rows: list[int], width: int, device: torch.device | str) -> torch.Tensor:
    """``t[rows, :width]`` on ``device``: a micro-batch's slice of a ``(bs, R)`` batch tensor."""
    return t[rows, :width].to(device)


def pad_to_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad the last dimension of ``x`` with zeros to ``width``."""
    return F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x


def require_packable(module: torch.nn.Module, key: str) -> None:
    """Raise ValueError naming ``key`` (the config key that asked for packing) when ``module``
    cannot run packed (:func:`packing_problem`); checked when a role is built, before any step."""
    problem = packing_problem(module)
    if problem is not None:
        raise ValueError(
            f"{key}=true (padding-free sequence packing; data.use_sequence_packing=true sets it too) "
            f"cannot run on this model: {problem}. Set {key}=false (and data.use_sequence_packing=false)"
        )


def _packed(module: torch.nn.Module, mb: MicroBatch, share_prompts: bool) -> PackedLayout:
    problem = packing_problem(module)
    if problem is not None:
        raise ValueError(f"sequence packing cannot run on this model: {problem}")
    return packed_layout(mb, token_cost_in_pairs(module), share_prompts)


def actor_forward(
    module: torch.nn.Module,
    mb: MicroBatch,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    share_prompts: bool = True,
    pack: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens under ``softmax(logits / temperature)``.

    .. math:: \\log\\pi(y_j) = \\mathrm{log\\_softmax}(z_{P+j-1} / \\tau)_{y_j}, \\qquad
              H_j = H(\\mathrm{softmax}(z_{P+j-1} / \\tau))

    With ``pack``, the micro-batch runs padding-free (:func:`rlmesh.learner.ppo.packed_layout.packed_layout`;
    ValueError when the model cannot, :func:`packing_problem`). Else, with ``share_prompts``,
    samples of one prompt run it once (:func:`shared_prompt_layout`) when the model allows and that
    costs less. The outputs are the padded layout's up to float rounding either way.

    Returns:
        log_probs: ``(n, w)`` fp32 (``w`` = the micro-batch's response width).
        entropy: ``(n, w)`` fp32, or None unless ``calculate_entropy``.
    """
    w = mb.response_width
    if pack:
        packed = _packed(module, mb, share_prompts)
        keep = packed.kept_columns()
        out = module(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
            use_cache=False,
            logits_to_keep=keep,
        )
        logits = out.logits[packed.row[:, None], torch.searchsorted(keep, packed.before)].float()
    else:
        layout = shared_prompt_layout(mb, token_cost_in_pairs(module)) if share_prompts else None
        if layout is None:
            # logits_to_keep: the LM head runs on the w + 1 last positions only, not the prompt.
            out = module(
                input_ids=mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids,
                use_cache=False,
                logits_to_keep=w + 1,
            )
            # fp32 so bf16 logits do not round the log-probs (the PPO ratio is exp of their difference).
            logits = out.logits[:, -w - 1 : -1, :].float()
        else:
            out = module(
                input_ids=layout.input_ids,
                attention_mask=layout.attention_mask,
                position_ids=layout.position_ids,
                use_cache=False,
                logits_to_keep=layout.kept_columns,
            )
            first = layout.prompt_width - 1  # the first kept column
            logits = out.logits[layout.group[:, None], layout.before - first].float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = logprobs_from_logits(logits, mb.responses)
    entropy = entropy_from_logits(logits) if calculate_entropy else None
    return log_probs, entropy


def critic_forward(
    module: torch.nn.Module, mb: MicroBatch, share_prompts: bool = True, pack: bool = False
) -> torch.Tensor:
    """Values ``V(s_{P+j-1})`` of the states before each response token, ``(n, w)`` fp32.

    The critic is a token-classification model with one label (verl's value model): its
    per-position score is the value. ``share_prompts``, ``pack``: as in :func:`actor_forward`.
    """
    w = mb.response_width
    if pack:
        packed = _packed(module, mb, share_prompts)
        out = module(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
            use_cache=False,
        )
        return out.logits[:, :, 0][packed.row[:, None], packed.before].float()
    layout = shared_prompt_layout(mb, token_cost_in_pairs(module)) if share_prompts else None
    if layout is None:
        out = module(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            use_cache=False,
        )
        return out.logits[:, -w - 1 : -1, 0].float()
    out = module(
        input_ids=layout.input_ids,
        attention_mask=layout.attention_mask,
        position_ids=layout.position_ids,
        use_cache=False,
    )
    return out.logits[:, :, 0][layout.group[:, None], layout.before].float()


def greedy_generate(
    module: torch.nn.Module,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    device: torch.device | str = "cpu",
    synced_gpus: bool = False,
) -> list[list[int]]:
    """HF greedy decoding of each prompt alone (no padding, so nothing depends on batch-mates),
    cut after the first eos token (the model's ``generation_config`` eos ids).

    Args:
        module: a causal LM (plain or peft-wrapped).
        synced_gpus: keep ZeRO-3 ranks stepping together (every rank must call with the same prompts).
    """
    from transformers import GenerationConfig

    hf = module.get_base_model() if hasattr(module, "get_base_model") else module
    eos = hf.generation_config.eos_token_id
    if eos is None:
        eos = hf.config.eos_token_id
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    pad = hf.generation_config.pad_token_id
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_ids or None,
        pad_token_id=pad if pad is not None else (eos_ids[0] if eos_ids else 0),
    )
    was_training = module.training
    module.eval()
    outputs = []
    try:
        with torch.no_grad():
            for ids in prompt_ids:
                x = torch.tensor([ids], dtype=torch.long, device=device)
                y = module.generate(
                    input_ids=x,
                    attention_mask=torch.ones_like(x),
                    generation_config=config,
                    synced_gpus=synced_gpus,
                )
                new = y[0, len(ids) :].tolist()
                end = next((j + 1 for j, tok in enumerate(new) if tok in eos_ids), len(new))
                outputs.append(new[:end])
    finally:
        module.train(was_training)
    return outputs
