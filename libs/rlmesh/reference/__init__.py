"""The frozen reference policy: per-token log-probs in token-budgeted micro-batches (``compute``,
which imports torch, loaded on first use), the service's servicer, and ``ReferenceClient`` for callers."""

from __future__ import annotations

from typing import Any

from rlmesh.reference.client import ReferenceClient
from rlmesh.reference.token_budget import padded_tokens, token_budget_micro_batches

_LAZY = {"compute_ref_log_probs", "ReferenceModel", "InvalidRequestError", "Cancelled"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from rlmesh.reference import compute

        return getattr(compute, name)
    raise AttributeError(f"module 'rlmesh.reference' has no attribute {name!r}")


__all__ = [
    "Cancelled",
    "InvalidRequestError",
    "ReferenceClient",
    "ReferenceModel",
    "compute_ref_log_probs",
    "padded_tokens",
    "token_budget_micro_batches",
]
