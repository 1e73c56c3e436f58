"""Tensor <-> ``rlmesh.v1.Tensor`` codec: raw little-endian bytes, no per-element Python loops.

docs/internals.md#rlmeshwirecodec"""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import torch

from rlmesh.v1 import tensor_pb2

Tensor = tensor_pb2.Tensor


class TensorDecodeError(ValueError):
    """A ``Tensor`` message that cannot be decoded; the message says which field is wrong."""


_TORCH_TO_PROTO: dict[torch.dtype, int] = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float64: tensor_pb2.DTYPE_FLOAT64,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.int16: tensor_pb2.DTYPE_INT16,
    torch.int8: tensor_pb2.DTYPE_INT8,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.bool: tensor_pb2.DTYPE_BOOL,
}
_PROTO_TO_TORCH: dict[int, torch.dtype] = {v: k for k, v in _TORCH_TO_PROTO.items()}

# numpy has no bfloat16: its bytes travel as little-endian uint16 bit patterns.
_PROTO_TO_NUMPY: dict[int, np.dtype] = {
    tensor_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    tensor_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    tensor_pb2.DTYPE_BFLOAT16: np.dtype("<u2"),
    tensor_pb2.DTYPE_FLOAT64: np.dtype("<f8"),
    tensor_pb2.DTYPE_INT64: np.dtype("<i8"),
    tensor_pb2.DTYPE_INT32: np.dtype("<i4"),
    tensor_pb2.DTYPE_INT16: np.dtype("<i2"),
    tensor_pb2.DTYPE_INT8: np.dtype("i1"),
    tensor_pb2.DTYPE_UINT8: np.dtype("u1"),
    tensor_pb2.DTYPE_BOOL: np.dtype("?"),
}
_NUMPY_TO_PROTO: dict[str, int] = {
    "float32": tensor_pb2.DTYPE_FLOAT32,
    "float16": tensor_pb2.DTYPE_FLOAT16,
    "float64": tensor_pb2.DTYPE_FLOAT64,
    "int64": tensor_pb2.DTYPE_INT64,
    "int32": tensor_pb2.DTYPE_INT32,
    "int16": tensor_pb2.DTYPE_INT16,
    "int8": tensor_pb2.DTYPE_INT8,
    "uint8": tensor_pb2.DTYPE_UINT8,
    "bool": tensor_pb2.DTYPE_BOOL,
}


def dtype_name(dtype: int) -> str:
    """``DTYPE_BFLOAT16`` -> ``"bfloat16"``; unknown values are reported by number."""
    try:
        return tensor_pb2.DType.Name(dtype).removeprefix("DTYPE_").lower()
    except ValueError:
        return f"<unknown dtype {dtype}>"


def _known_dtypes() -> str:
    return ", ".join(dtype_name(d) for d in _PROTO_TO_NUMPY)


def torch_to_proto(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    """Encodes a CPU or GPU torch tensor (any layout of strides) as a ``Tensor`` message."""
    if tensor.dtype not in _TORCH_TO_PROTO:
        raise TypeError(f"cannot encode torch dtype {tensor.dtype}; supported: {_known_dtypes()}")
    proto_dtype = _TORCH_TO_PROTO[tensor.dtype]
    t = tensor.detach().to("cpu").contiguous()
    # Reinterpret bf16 as int16 so numpy can expose the buffer; the bit pattern is unchanged.
    array = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return _array_to_proto(array, proto_dtype, tuple(t.shape))


def numpy_to_proto(array: np.ndarray) -> tensor_pb2.Tensor:
    """Encodes a numpy array as a ``Tensor`` message (byte order normalised to little-endian)."""
    name = array.dtype.name
    if name not in _NUMPY_TO_PROTO:
        raise TypeError(f"cannot encode numpy dtype {array.dtype}; supported: {', '.join(_NUMPY_TO_PROTO)}")
    return _array_to_proto(array, _NUMPY_TO_PROTO[name], array.shape)


def _array_to_proto(array: np.ndarray, proto_dtype: int, shape: tuple[int, ...]) -> tensor_pb2.Tensor:
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return tensor_pb2.Tensor(dtype=proto_dtype, shape=list(shape), data=np.ascontiguousarray(array).tobytes())


def _checked_layout(msg: tensor_pb2.Tensor) -> tuple[np.dtype, tuple[int, ...]]:
    """Returns the wire numpy dtype and shape, or raises naming the malformed field."""
    if msg.dtype not in _PROTO_TO_NUMPY:
        raise TensorDecodeError(
            f"Tensor.dtype: unknown dtype {dtype_name(msg.dtype)}; known: {_known_dtypes()}"
        )
    shape = tuple(int(d) for d in msg.shape)
    for i, d in enumerate(shape):
        if d < 0:
            raise TensorDecodeError(
                f"Tensor.shape: negative dimension {d} at index {i} in shape {list(shape)}"
            )
    wire = _PROTO_TO_NUMPY[msg.dtype]
    expected = math.prod(shape) * wire.itemsize
    if len(msg.data) != expected:
        raise TensorDecodeError(
            f"Tensor.data: byte length {len(msg.data)} != {expected} "
            f"(shape {list(shape)} x itemsize {wire.itemsize} for {dtype_name(msg.dtype)})"
        )
    return wire, shape


def proto_to_numpy(msg: tensor_pb2.Tensor, *, copy: bool = False) -> np.ndarray:
    """Decodes to numpy. Without ``copy`` the result is a read-only view of ``msg.data``.

    bfloat16 has no numpy dtype: it decodes to its uint16 bit patterns (use ``proto_to_torch``).
    """
    wire, shape = _checked_layout(msg)
    array = np.frombuffer(msg.data, dtype=wire).reshape(shape)
    if sys.byteorder == "big" and wire.itemsize > 1:
        array = array.astype(wire.newbyteorder("="))
    return array.copy() if copy else array


def proto_to_torch(msg: tensor_pb2.Tensor, *, copy: bool = True) -> torch.Tensor:
    """Decodes to a CPU torch tensor. ``copy=False`` aliases ``msg.data``: never write to it."""
    wire, shape = _checked_layout(msg)
    torch_dtype = _PROTO_TO_TORCH[msg.dtype]
    if len(msg.data) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if sys.byteorder == "big" and wire.itemsize > 1:
        copy = True  # byte swapping needs a copy anyway
        data: bytes | bytearray = proto_to_numpy(msg, copy=True).tobytes()
    else:
        data = bytearray(msg.data) if copy else msg.data
    with warnings.catch_warnings():
        # torch warns on read-only buffers; with copy=False that aliasing is the caller's choice.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch_dtype)
    return flat.reshape(shape)


def to_proto(value: torch.Tensor | np.ndarray) -> tensor_pb2.Tensor:
    """Encodes either a torch tensor or a numpy array."""
    if isinstance(value, torch.Tensor):
        return torch_to_proto(value)
    if isinstance(value, np.ndarray):
        return numpy_to_proto(value)
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
