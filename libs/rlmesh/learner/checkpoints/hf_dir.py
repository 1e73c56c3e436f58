"""Writing an HF model directory: safetensors shards, configs and the tokenizer files."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["copy_tokenizer", "write_hf_dir"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_tokenizer(tokenizer_path: str, out_dir: str | os.PathLike[str]) -> None:
    """Copy the tokenizer files of a local directory as they are (an exact round trip), or save
    the tokenizer ``AutoTokenizer`` loads from ``tokenizer_path``."""
    src = Path(os.path.expanduser(tokenizer_path))
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()] if src.is_dir() else []
    for name in copied:
        shutil.copyfile(src / name, Path(out_dir) / name)
    if not copied:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(src) if src.exists() else tokenizer_path).save_pretrained(
            str(out_dir)
        )


def write_hf_dir(
    out_dir: str | os.PathLike[str],
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    config: Any,
    generation_config: Any,
    tokenizer_path: str | None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the tensors of ``buckets`` (one safetensors shard per bucket, HF's index when more
    than one), the model config with its dtype, the generation config and the tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    shards: list[tuple[Path, list[str]]] = []
    total = 0
    saved_dtype = dtype
    for bucket in buckets:
        if not bucket:
            continue
        tensors = {}
        for name, t in bucket:
            t = t.detach().to("cpu")
            tensors[name] = (t if dtype is None else t.to(dtype)).contiguous()
            saved_dtype = saved_dtype or tensors[name].dtype
            total += tensors[name].numel() * tensors[name].element_size()
        part = out / f"part-{len(shards):05d}.safetensors.tmp"
        save_file(tensors, str(part), metadata={"format": "pt"})
        shards.append((part, list(tensors)))
    if len(shards) == 1:
        os.replace(shards[0][0], out / "model.safetensors")
    else:
        weight_map = {}
        for k, (part, names) in enumerate(shards, start=1):
            final = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            os.replace(part, out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = copy.deepcopy(config)
    if saved_dtype is not None:
        config.dtype = saved_dtype
    config.save_pretrained(str(out))
    if generation_config is not None:
        generation_config.save_pretrained(str(out))
    if tokenizer_path:
        copy_tokenizer(tokenizer_path, out)
    return out
