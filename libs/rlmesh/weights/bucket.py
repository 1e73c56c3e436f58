"""How a bucket of tensors travels in one broadcast: SGLang's ``load_format="flattened_bucket"``,
with CPU buffers reused between pushes. docs/design.md#buckets-groups-and-names"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLATTENED_BUCKET = "flattened_bucket"
# ``load_format`` values of /update_weights_from_distributed: None = one broadcast per tensor.
LOAD_FORMATS = (None, FLATTENED_BUCKET)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layout(
    dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]], align: int = 1
) -> tuple[list[int], int]:
    """Byte offset of each tensor and the total, each tensor starting on a multiple of ``align``
    (1: packed back to back, the flattened_bucket wire layout)."""
    offsets, end = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        end = -(-end // align) * align
        offsets.append(end)
        end += torch.Size(shape).numel() * dtype.itemsize
    return offsets, end


def uint8_buffer(size: int, device: torch.device | str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``size`` bytes: the front of ``out`` when it is a big enough uint8 buffer on ``device``,
    else a new buffer."""
    if (
        out is not None
        and out.dtype == torch.uint8
        and out.device == torch.device(device)
        and out.numel() >= size
    ):
        return out[:size]
    return torch.empty(size, dtype=torch.uint8, device=device)


def packed_bytes(
    tensors: Sequence[torch.Tensor], device: torch.device | str | None = None
) -> torch.Tensor | None:
    """The flattened_bucket bytes of ``tensors`` without a copy when they already lie back to back,
    in order, in one storage (on ``device`` when given) — a trainer that packs its weights, as the
    learner's push buckets do: a uint8 view of that storage. None otherwise."""
    if not tensors:
        return None
    first = tensors[0]
    if device is not None and first.device != torch.device(device):
        return None
    storage = first.untyped_storage()
    start = end = first.storage_offset() * first.element_size()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.device != first.device
            or t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.storage_offset() * t.element_size() != end
        ):
            return None
        end += nbytes(t)
    whole = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
    return whole[start:end]


def flatten_tensors(
    tensors: Sequence[torch.Tensor],
    device: torch.device | str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The flattened_bucket bytes of ``tensors``: one contiguous uint8 tensor, each tensor copied
    once straight into it. ``device`` defaults to the first tensor's; ``out``: a buffer to write
    into when it is big enough (the result is then a view of its front)."""
    if device is None:
        device = tensors[0].device if tensors else "cpu"
    flat = uint8_buffer(sum(nbytes(t) for t in tensors), device, out)
    offset = 0
    for t in tensors:
        n = nbytes(t)
        # reshape(-1) is a view of a contiguous tensor; view(uint8) reinterprets its bytes.
        flat[offset : offset + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        offset += n
    return flat


def tensor_views(
    buffer: torch.Tensor,
    offsets: Sequence[int],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """The tensors at ``offsets`` in a uint8 ``buffer``: views, no copy — except a tensor whose
    offset is not a multiple of its element size (``view(dtype)`` needs that), which is copied."""
    out = []
    for offset, dtype, shape in zip(offsets, dtypes, shapes, strict=True):
        size = torch.Size(shape)
        piece = buffer[offset : offset + size.numel() * dtype.itemsize]
        if offset % dtype.itemsize:
            piece = piece.clone()
        out.append(piece.view(dtype).view(size))
    return out


def unflatten_tensors(
    flat: torch.Tensor, dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """The inverse of ``flatten_tensors``: views of ``flat``, which must hold exactly their bytes."""
    offsets, total = layout(dtypes, shapes)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != total:
        raise ValueError(
            f"a flattened bucket of these tensors is {total} uint8 bytes; got {flat.dtype} {list(flat.shape)}"
        )
    return tensor_views(flat, offsets, dtypes, shapes)
