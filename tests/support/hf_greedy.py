"""A checkpoint's held-out score with nothing of the pipeline: plain HF ``generate`` (greedy) on the
split's prompts, rendered by the tokenizer's chat template, scored by the task's built-in reward."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM

from rlmesh.models import load_tokenizer
from rlmesh.reward.builtin import default_compute_score


def greedy_score(model_dir: Path, split: Path, max_new_tokens: int) -> float:
    """Mean reward of the greedy responses of the model in ``model_dir`` to every row of the
    Parquet ``split`` (verl's layout: ``prompt`` messages, ``data_source``, ``reward_model``)."""
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = pq.read_table(split).to_pylist()
    # Prompts of one length generate together: no padding, so nothing depends on how a batch is padded.
    by_length: dict[int, list[tuple[list[int], dict]]] = defaultdict(list)
    for row in rows:
        # Parquet gives every message every key seen in the column: the unset ones are None.
        messages = [{k: v for k, v in m.items() if v is not None} for m in row["prompt"]]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        by_length[len(ids)].append((ids, row))
    total = 0.0
    for length, group in by_length.items():
        ids = torch.tensor([g[0] for g in group])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        texts = tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
        for text, (_, row) in zip(texts, group, strict=True):
            score = default_compute_score(row["data_source"], text, row["reward_model"]["ground_truth"])
            total += float(score["score"] if isinstance(score, dict) else score)
    return total / len(rows)
