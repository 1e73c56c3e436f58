"""Tokenizer and tiny-model builders (everything local: no hub, no downloads)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlmesh.models.tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    IM_START,
    build_tokenizer,
    load_tokenizer,
)

if TYPE_CHECKING:
    from rlmesh.models.tiny import build_tiny_model

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_END",
    "IM_START",
    "build_tiny_model",
    "build_tokenizer",
    "load_tokenizer",
]


def __getattr__(name: str) -> Any:
    # On first use: it imports torch and the model classes (seconds), which a process that only
    # needs the tokenizer (a rollout replica, whose engine is its own process) never pays for.
    if name == "build_tiny_model":
        from rlmesh.models.tiny import build_tiny_model

        return build_tiny_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
