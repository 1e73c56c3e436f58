"""Tokenizer and tiny-model builders (everything local: no hub, no downloads)."""

from rlmesh.models.tiny import build_tiny_model
from rlmesh.models.tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    IM_START,
    build_tokenizer,
    load_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_END",
    "IM_START",
    "build_tiny_model",
    "build_tokenizer",
    "load_tokenizer",
]
