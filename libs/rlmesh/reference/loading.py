"""Loading the service's reference model from the config, or deciding to start without one."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlmesh.config import RLMeshConfig
    from rlmesh.reference.compute import ReferenceModel

log = logging.getLogger("rlmesh.reference")


class ReferenceLoadError(RuntimeError):
    """The reference model cannot be loaded; the message says where and why."""


def reference_model_path(cfg: RLMeshConfig) -> str:
    """``rlmesh.reference.model_path``, else the initial actor (verl's reference)."""
    return cfg.rlmesh.reference.model_path or cfg.actor_rollout_ref.model.path


def reference_max_tokens(cfg: RLMeshConfig) -> int:
    """Tokens per forward: padding included, or the real tokens of a packed one."""
    return cfg.rlmesh.reference.max_tokens or cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu


def load_reference_model(cfg: RLMeshConfig) -> ReferenceModel | None:
    """The reference model, or None when its path does not exist and the config uses no KL to it.
    Raises ``ReferenceLoadError`` when a model that is asked for does not load."""
    path = reference_model_path(cfg)
    needed = cfg.uses_reference()
    # A path that is not a local directory may still be a hub id in the local HF cache: try it
    # when the run needs the reference; otherwise start without a model.
    if not (Path(path).expanduser().exists() or cfg.rlmesh.reference.model_path or needed):
        return None
    try:
        model = _load(cfg, path)
    except Exception as e:
        why = (
            " (this config needs the reference: algorithm.use_kl_in_reward or "
            "actor_rollout_ref.actor.use_kl_loss is true)"
            if needed
            else ""
        )
        raise ReferenceLoadError(
            f"cannot load the reference model at {path!r}{why}: {type(e).__name__}: {e}"
        ) from e
    log.info(
        "reference model ready",
        extra={
            "model_path": path,
            "dtype": model.dtype_name,
            "device": str(model.device),
            "vocab_size": model.vocab_size,
            "max_tokens_per_batch": reference_max_tokens(cfg),
        },
    )
    return model


def _load(cfg: RLMeshConfig, path: str) -> ReferenceModel:
    import torch

    from rlmesh.reference.compute import ReferenceModel

    section = cfg.rlmesh.reference
    temperature = cfg.actor_rollout_ref.rollout.temperature
    if temperature <= 0:
        log.warning("rollout.temperature is %s (greedy): reference log-probs use temperature 1", temperature)
        temperature = 1.0
    model_cfg = cfg.actor_rollout_ref.model
    return ReferenceModel.load(
        path,
        device=section.device,
        dtype=getattr(torch, section.dtype) if section.dtype else None,
        trust_remote_code=model_cfg.trust_remote_code,
        override_config=model_cfg.override_config or None,
        max_tokens_per_batch=reference_max_tokens(cfg),
        max_samples_per_batch=cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
        max_batch_size=section.max_batch_size,
        temperature=temperature,
        pack=bool(model_cfg.use_remove_padding),
    )
