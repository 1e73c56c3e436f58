"""Read-back checks of a push: sampled tensors' first rows compared with each engine's copy."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence

import torch

from rlmesh.engine.client import EngineClient, EngineError
from rlmesh.learner.weight_sync.links import EngineLink

log = logging.getLogger("rlmesh.weights")

# How a server says it cannot read a parameter back. SGLang 0.5.23 answers 400 "Get parameter by
# name failed" whenever its model class has no get_weights_by_name (Qwen2, Qwen3, ...) or the read
# raised (http_server.py, weight_exporter.py): for a name it has just loaded, that is the model,
# not the push. Older servers named the missing attribute. Any other refusal is a mismatch.
_UNSUPPORTED = re.compile(
    r"get parameter by name failed|attribute|not (implemented|supported)", re.IGNORECASE
)

# Rows of each checked tensor fetched from an engine: enough to catch a stale or misplaced tensor,
# few enough to keep the JSON small (8 rows of a 4096-wide matrix: 32k numbers).
VERIFY_ROWS = 8


class VerifySample:
    """Picks ``count`` tensors of a push, spread over it by the tensor count of the last push (the
    first ``count`` on a first push), and keeps their first ``VERIFY_ROWS`` rows as float32."""

    def __init__(self, count: int, tensors_last_push: int) -> None:
        self.count = count
        self.stride = max(1, tensors_last_push // count) if count else 0
        self.seen = 0
        self.rows: dict[str, torch.Tensor] = {}

    def offer(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, t in bucket:
            if self.count and len(self.rows) < self.count and self.seen % self.stride == 0:
                self.rows[name] = first_rows(t, VERIFY_ROWS).clone()  # the bucket's storage may go
            self.seen += 1


async def check_engines(
    targets: list[EngineLink], failed: dict[str, str], rows: dict[str, torch.Tensor]
) -> None:
    """Compares the sampled ``rows`` with each engine's not failed yet; an engine that differs, or
    whose answer fails, fails. One that cannot answer at all is no longer checked."""

    async def one(link: EngineLink) -> None:
        try:
            differ = await differing(link.client, rows, VERIFY_ROWS)
        except EngineError as e:
            if not (e.status == 404 or (e.status == 400 and _UNSUPPORTED.search(str(e)))):
                raise
            link.verifiable = False
            log.warning(
                "engine %s cannot read its weights back (/get_weights_by_name: %s): pushes to it are "
                "not checked (counted in weight_sync/unchecked_engines)",
                link.name,
                e,
            )
            return
        if differ:
            failed[link.name] = f"after the push it holds other values for {', '.join(differ)}"
            log.error("engine %s: weights differ from the pushed ones: %s", link.name, differ)

    async def guarded(link: EngineLink) -> None:
        try:
            await one(link)
        except (EngineError, OSError) as e:
            failed[link.name] = f"checking the pushed weights: {e}"

    if rows:
        await asyncio.gather(
            *(guarded(link) for link in targets if link.name not in failed and link.verifiable)
        )


def first_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """What ``/get_weights_by_name`` answers with ``truncate_size=rows``, as float32 on the CPU."""
    return t.detach()[:rows].to(torch.float32).cpu()


async def differing(client: EngineClient, rows: dict[str, torch.Tensor], truncate_size: int) -> list[str]:
    """The names among ``rows`` (each tensor's ``first_rows``) whose values the engine holds
    otherwise (``same_values``)."""
    differ = []
    for name, ours in rows.items():
        theirs = torch.tensor(await client.get_weights_by_name(name, truncate_size), dtype=torch.float32)
        if not same_values(ours, theirs):
            differ.append(name)
    return differ


def same_values(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Whether an engine's copy equals ours: exactly, or rounded to the half-precision dtype the
    engine may hold (SGLang loads fp32 pushes into bf16 or fp16 parameters)."""
    if ours.shape != theirs.shape:
        return False
    return any(
        torch.equal(ours.to(dtype).to(torch.float32), theirs)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
