"""Tiny random-init causal LMs for CPU tests and the demo.

docs/internals.md#rlmeshmodelstiny"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rlmesh.models.tokenizer import IM_END, build_tokenizer, save_tokenizer

ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tiny_model(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool = True,
) -> Path:
    """Build a random-init HF causal LM sized to ``tokenizer``; save it (safetensors) and the tokenizer
    into out_dir. The same arguments and seed give bit-identical weights."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    config_cls, model_cls = ARCHS[arch]
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    # Qwen2 has no bos token; like Qwen2's config we point bos at eos.
    bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos_id
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype)
    model.config.dtype = dtype
    # Chat replies end with <|im_end|>; stop on it as well as on eos (as Qwen2-Instruct does).
    eos_ids = [eos_id]
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end != eos_id:
        eos_ids.append(im_end)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=pad_id)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tokenizer, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlmesh.models.tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (model + tokenizer)")
    p.add_argument("--arch", default="qwen2", choices=sorted(ARCHS))
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=None, help="default 4 x hidden size")
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--untie-word-embeddings", action="store_true")
    args = p.parse_args(argv)

    tokenizer = build_tokenizer()
    out = build_tiny_model(
        args.out,
        tokenizer,
        arch=args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        seed=args.seed,
        dtype=DTYPES[args.dtype],
        tie_word_embeddings=not args.untie_word_embeddings,
    )
    for f in sorted(out.iterdir()):
        print(f"wrote {f} ({f.stat().st_size} bytes)")
    print(f"{args.arch} model, vocab {len(tokenizer)}, hidden {args.hidden_size}, layers {args.num_layers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
