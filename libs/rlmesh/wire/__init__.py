"""The wire: generated protobuf code lives in ``rlmesh.v1``; codecs and helpers here."""

from rlmesh.wire.codec import (
    TensorDecodeError,
    dtype_name,
    numpy_to_proto,
    proto_to_numpy,
    proto_to_torch,
    to_proto,
    torch_to_proto,
)

__all__ = [
    "TensorDecodeError",
    "dtype_name",
    "numpy_to_proto",
    "proto_to_numpy",
    "proto_to_torch",
    "to_proto",
    "torch_to_proto",
]
