"""The actor (a causal LM) and the critic (a token-classification model with one label), as verl
builds them, optionally with LoRA adapters through peft."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedModel

__all__ = [
    "DTYPES",
    "apply_lora",
    "first_policy_version",
    "hf_model",
    "is_peft",
    "load_actor_model",
    "load_critic_model",
    "load_lora_adapter",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ADAPTER_KEY = "actor_rollout_ref.model.lora_adapter_path"

log = logging.getLogger("rlmesh.learner")


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    # from_pretrained prints a load report for the newly initialised value head; it is expected.
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _model_config(path: str, trust_remote_code: bool, override_config: dict[str, Any]) -> Any:
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for key, value in override_config.items():
        setattr(config, key, value)
    return config


def _enable_checkpointing(model: PreTrainedModel) -> None:
    # Non-reentrant checkpointing (verl's choice); transformers 5 renamed the method.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_peft(module: torch.nn.Module) -> bool:
    """True for a peft ``PeftModel`` (LoRA-wrapped model)."""
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def hf_model(module: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside ``module`` (a peft wrapper's base model, LoRA layers included)."""
    return module.get_base_model() if is_peft(module) else module  # type: ignore[return-value]


@contextlib.contextmanager
def _frozen_base(model: PreTrainedModel) -> Iterator[None]:
    """Around wrapping ``model`` in LoRA: its own weights freeze, so checkpointed blocks need an
    input that requires grad; and peft's question about checkpointing must not warn."""
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers < 5
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        model.enable_input_require_grads()
    with warnings.catch_warnings():
        # peft asks transformers 5 for is_gradient_checkpointing, which warns of its rename.
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


def apply_lora(
    model: PreTrainedModel, lora_rank: int, lora_alpha: int, target_modules: str | list[str], task_type: str
) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters (verl: ``bias='none'``); only adapter weights (and, for a
    token-classification critic, peft's value head copy) stay trainable."""
    from peft import LoraConfig, get_peft_model

    lora_config = LoraConfig(
        task_type=task_type,
        r=lora_rank,
        lora_alpha=lora_alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        bias="none",
    )
    with _frozen_base(model):
        return get_peft_model(model, lora_config)


def load_lora_adapter(model: PreTrainedModel, adapter_path: str) -> torch.nn.Module:
    """Wrap ``model`` with the pretrained PEFT LoRA adapter saved at ``adapter_path``, trainable
    (``actor_rollout_ref.model.lora_adapter_path``; verl: ``PeftModel.from_pretrained(...,
    is_trainable=True)``). Rank, alpha and target modules are the adapter's own (its
    adapter_config.json), as in verl. Raises ValueError naming the key and the path when the
    directory holds no LoRA adapter, or one that does not fit the model."""
    from peft import PeftConfig, PeftModel

    path = os.path.expanduser(adapter_path)
    where = f"{ADAPTER_KEY}={adapter_path!r}"
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ValueError(f"{where}: not a PEFT adapter directory (no adapter_config.json in {path})")
    try:
        config = PeftConfig.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"{where}: unreadable adapter_config.json: {type(e).__name__}: {e}") from None
    if config.peft_type != "LORA":  # PeftType is a str enum
        raise ValueError(f"{where}: a {config.peft_type} adapter, not LoRA")
    config.task_type = "CAUSAL_LM"  # verl does too: an adapter saved without one is still a causal LM's
    try:
        with _frozen_base(model):
            module = PeftModel.from_pretrained(model, path, config=config, is_trainable=True)
    except Exception as e:  # no weights file, target modules the model lacks, shapes that differ
        raise ValueError(f"{where}: the adapter does not load onto the model: {type(e).__name__}: {e}") from e
    log.info(
        "LoRA adapter %s: rank %d, alpha %s, targets %s",
        path,
        config.r,
        config.lora_alpha,
        config.target_modules,
    )
    return module


def first_policy_version(lora_adapter_path: str | None) -> int:
    """The policy version of the weights training starts from. Version 0 is ``model.path`` itself,
    what an engine loads at start; base + a pretrained adapter (``lora_adapter_path``) is another
    policy, version 1, so an engine that has not been pushed it yet counts as behind."""
    return 0 if lora_adapter_path is None else 1


def load_actor_model(
    path: str,
    *,
    seed: int = 0,
    lora_rank: int = 0,
    lora_alpha: int = 16,
    target_modules: str | list[str] = "all-linear",
    lora_adapter_path: str | None = None,
    enable_gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """``AutoModelForCausalLM`` in fp32 (DeepSpeed casts to the training dtype and keeps fp32
    master weights), LoRA-wrapped: with the pretrained adapter at ``lora_adapter_path`` when it is
    set (:func:`load_lora_adapter`; verl 0.7's workers too turn LoRA on for it alone), else with new
    adapters initialised from ``seed`` when ``lora_rank > 0`` (the caller's RNG is left untouched)."""
    path = os.path.expanduser(path)
    config = _model_config(path, trust_remote_code, override_config or {})
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    if enable_gradient_checkpointing:
        _enable_checkpointing(model)
    if lora_rank > 0 or lora_adapter_path is not None:
        with torch.random.fork_rng(devices=[]):  # peft initialises even the layers it then loads
            torch.manual_seed(seed)
            if lora_adapter_path is not None:
                return load_lora_adapter(model, lora_adapter_path)
            return apply_lora(model, lora_rank, lora_alpha, target_modules, task_type="CAUSAL_LM")
    return model


def load_critic_model(
    path: str,
    *,
    seed: int = 0,
    lora_rank: int = 0,
    lora_alpha: int = 16,
    target_modules: str | list[str] = "all-linear",
    enable_gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """verl's value model: ``AutoModelForTokenClassification`` with ``num_labels=1`` and no dropout
    on the head, its new head initialised from ``seed`` (the caller's RNG is left untouched)."""
    path = os.path.expanduser(path)
    config = _model_config(path, trust_remote_code, override_config or {})
    config.num_labels = 1
    # verl: a value head must not drop out (train and eval values would disagree).
    config.classifier_dropout = 0.0
    config.summary_dropout_prob = 0.0
    with torch.random.fork_rng(devices=[]), _quiet_transformers():
        torch.manual_seed(seed)
        model = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    if enable_gradient_checkpointing:
        _enable_checkpointing(model)
    if lora_rank > 0:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            return apply_lora(model, lora_rank, lora_alpha, target_modules, task_type="TOKEN_CLS")
    return model
