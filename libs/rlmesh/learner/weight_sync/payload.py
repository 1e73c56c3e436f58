"""A push's tensors cut into buckets, and each bucket packed into what its broadcast sends; the wire
layout is ``rlmesh.weights.bucket``'s, this module decides order, copies and buffer reuse."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlmesh.weights.bucket import FLATTENED_BUCKET, flatten_tensors, packed_bytes

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def buckets(named: NamedTensors, bucket_bytes: int) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """``named`` in order, cut after the tensor that brings a bucket to ``bucket_bytes``."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def aligned(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The bucket with every tensor at a byte offset that is a multiple of its element size once
    flattened (SGLang refuses, or fails on, any other): by descending element size, otherwise in
    order — so a bucket of one dtype, the usual case, is unchanged."""
    return sorted(bucket, key=lambda item: -item[1].element_size())


class Packer:
    """Builds each bucket's broadcast payload for a backend; on CPU it keeps the flattened-bucket
    buffer (one bucket's bytes) from bucket to bucket and push to push."""

    def __init__(self) -> None:
        self.flat: torch.Tensor | None = None

    def payload(
        self, tensors: list[torch.Tensor], load_format: str | None, backend: str
    ) -> list[torch.Tensor]:
        """What to broadcast, in order, shared by every engine of ``load_format`` and ``backend``:
        one flat uint8 tensor (flattened_bucket) or the tensors themselves; on the CPU for gloo,
        where the tensors are for NCCL."""
        device = "cpu" if backend == "gloo" else None
        if load_format == FLATTENED_BUCKET:
            packed = packed_bytes(tensors, device)
            if packed is not None:
                return [packed]  # already laid out as the bucket: no copy
            # One copy into one buffer. On CPU the buffer is kept for the next bucket and push
            # (its first touch page-faults, which costs more than the copy); on GPU torch's
            # caching allocator already reuses memory.
            flat = flatten_tensors(tensors, device, self.flat)
            if flat.device.type == "cpu" and (self.flat is None or flat.numel() > self.flat.numel()):
                self.flat = flat
            return [flat]
        # .contiguous() and .to() return the tensor itself when it already is: no copy then.
        return [t.contiguous() if device is None else t.contiguous().to(device) for t in tensors]

    def forget(self) -> None:
        """Drops the kept buffer: a transport or a cancelled sending thread may still hold it."""
        self.flat = None
