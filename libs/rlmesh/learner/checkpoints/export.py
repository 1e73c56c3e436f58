"""HF directories of the actor from a learner checkpoint on disk (``rlmesh export``).

docs/train.md#rlmesh-export"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from rlmesh.learner.checkpoints.hf_dir import write_hf_dir
from rlmesh.learner.checkpoints.store import (
    CheckpointError,
    is_complete,
    latest_checkpoint,
    load_tensors,
    weights_only_loads,
)
from rlmesh.learner.ppo.model_loading import DTYPES, load_actor_model
from rlmesh.learner.weight_sync.full_weights import iter_weight_buckets

__all__ = ["export_checkpoint", "main"]


def _actor_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The actor's module state dict from a learner checkpoint, full and fp32 for ZeRO stages."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    actor_dir = checkpoint / "actor"
    if state["zero_stage"]["actor"] == 0:
        files = sorted((actor_dir / "state").glob("mp_rank_*_model_states.pt"))
        if not files:
            raise CheckpointError(f"no model states under {actor_dir / 'state'}")
        return load_tensors(files[0])["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with weights_only_loads():  # DeepSpeed's merge would unpickle the partitions
        return get_fp32_state_dict_from_zero_checkpoint(str(actor_dir), tag="state")


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    dtype: str = "auto",
) -> Path:
    """Export the actor of a learner checkpoint as an HF directory (see the module docstring).

    Args:
        checkpoint: a checkpoint directory, or a directory holding several (latest complete one).
        out_dir: where to write.
        config_path: the run's config; default the ``config.yaml`` saved in the checkpoint.
        overrides: dotted config overrides.
        dtype: ``auto`` (the actor's training dtype), ``float32``, ``bfloat16`` or ``float16``.
    """
    from rlmesh.config import load_config

    ckpt = Path(checkpoint)
    if not is_complete(ckpt):
        latest = latest_checkpoint(ckpt)
        if latest is None:
            raise CheckpointError(f"{ckpt} is not a complete checkpoint and holds none")
        ckpt = Path(latest)
    cfg = load_config(config_path or ckpt / "config.yaml", list(overrides))
    model = cfg.actor_rollout_ref.model
    module = load_actor_model(
        model.path,
        lora_rank=model.lora_rank,
        lora_alpha=model.lora_alpha,
        target_modules=model.target_modules,
        lora_adapter_path=model.lora_adapter_path,  # the adapter's LoRA layout; the checkpoint's weights
        trust_remote_code=model.trust_remote_code,
        override_config=model.override_config,
    )
    state_dict = _actor_state_dict(ckpt)
    result = module.load_state_dict(state_dict, strict=False)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    missing = sorted(set(result.missing_keys) & trainable)
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{ckpt}: the actor checkpoint does not match {model.path} (+ LoRA rank {model.lora_rank}): "
            f"missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    if dtype == "auto":
        dtype = cfg.actor_rollout_ref.actor.effective_engine().dtype
    hf = module.get_base_model() if hasattr(module, "get_base_model") else module
    return write_hf_dir(
        out_dir,
        iter_weight_buckets(module, 2 << 30, zero3=False, materialize=True),
        hf.config,
        hf.generation_config,
        cfg.tokenizer_path(),
        dtype=DTYPES[dtype],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlmesh export", description="Write an HF directory of the actor from a learner checkpoint."
    )
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (or a directory of them)")
    parser.add_argument("--out", required=True, help="output HF directory")
    parser.add_argument(
        "--config", "-c", default=None, help="config file; default the checkpoint's config.yaml"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weights dtype")
    args, overrides = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    from rlmesh.config import ConfigError

    try:
        out = export_checkpoint(args.checkpoint, args.out, args.config, overrides, args.dtype)
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"rlmesh export: {e}", file=sys.stderr)
        return 1
    print(f"exported the actor to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
