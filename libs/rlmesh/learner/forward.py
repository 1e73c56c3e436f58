"""Forward passes of one micro-batch: per-token log-probs/entropies (actor) and values (critic).

docs/internals.md#rlmeshlearnerforward"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlmesh.algo import entropy_from_logits, logprobs_from_logits
from rlmesh.learner.batch import PPOBatch

__all__ = [
    "MicroBatch",
    "actor_forward",
    "critic_forward",
    "greedy_generate",
    "pad_to_width",
    "rows_of",
    "slice_micro_batch",
]


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


def rows_of(t: torch.Tensor, rows: list[int], width: int, device: torch.device | str) -> torch.Tensor:
    """``t[rows, :width]`` on ``device``: a micro-batch's slice of a ``(bs, R)`` batch tensor."""
    return t[rows, :width].to(device)


def pad_to_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad the last dimension of ``x`` with zeros to ``width``."""
    return F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x


def actor_forward(
    module: torch.nn.Module, mb: MicroBatch, temperature: float = 1.0, calculate_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens under ``softmax(logits / temperature)``.

    .. math:: \\log\\pi(y_j) = \\mathrm{log\\_softmax}(z_{P+j-1} / \\tau)_{y_j}, \\qquad
              H_j = H(\\mathrm{softmax}(z_{P+j-1} / \\tau))

    Returns:
        log_probs: ``(n, w)`` fp32 (``w`` = the micro-batch's response width).
        entropy: ``(n, w)`` fp32, or None unless ``calculate_entropy``.
    """
    w = mb.response_width
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
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = logprobs_from_logits(logits, mb.responses)
    entropy = entropy_from_logits(logits) if calculate_entropy else None
    return log_probs, entropy


def critic_forward(module: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Values ``V(s_{P+j-1})`` of the states before each response token, ``(n, w)`` fp32.

    The critic is a token-classification model with one label (verl's value model): its
    per-position score is the value.
    """
    w = mb.response_width
    out = module(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        use_cache=False,
    )
    return out.logits[:, -w - 1 : -1, 0].float()


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
