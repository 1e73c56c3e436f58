import numpy as np
import pytest
import torch

from rlmesh.v1 import tensor_pb2
from rlmesh.wire import (
    TensorDecodeError,
    numpy_to_proto,
    proto_to_numpy,
    proto_to_torch,
    to_proto,
    torch_to_proto,
)

TORCH_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 5)])
def test_torch_round_trip_is_bit_exact(dtype, shape):
    t = _sample(dtype, shape)
    msg = torch_to_proto(t)
    assert list(msg.shape) == list(shape)
    back = proto_to_torch(tensor_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and back.shape == t.shape
    # Compare bytes, not values, so NaN payloads and -0.0 count too.
    assert _raw(back) == _raw(t)


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def test_bf16_bytes_are_the_raw_bit_patterns():
    t = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    msg = torch_to_proto(t)
    # bf16 of 1.0 is 0x3F80, -2.0 is 0xC000, 0.5 is 0x3F00, little-endian.
    assert msg.data == bytes([0x80, 0x3F, 0x00, 0xC0, 0x00, 0x3F])
    assert proto_to_numpy(msg).tolist() == [0x3F80, 0xC000, 0x3F00]


def test_float32_wire_bytes_are_little_endian():
    msg = to_proto(np.array([1.0], dtype=np.float32))
    assert msg.data == bytes([0x00, 0x00, 0x80, 0x3F])


@pytest.mark.parametrize(
    "np_dtype", ["float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"]
)
def test_numpy_round_trip(np_dtype):
    a = (np.arange(24).reshape(2, 3, 4) % 7).astype(np_dtype)
    back = proto_to_numpy(numpy_to_proto(a))
    assert back.dtype == a.dtype and back.shape == a.shape
    np.testing.assert_array_equal(back, a)


def test_big_endian_numpy_input_is_normalised():
    a = np.array([1, 2, 3], dtype=">i4")
    msg = numpy_to_proto(a)
    assert msg.data == np.array([1, 2, 3], dtype="<i4").tobytes()
    np.testing.assert_array_equal(proto_to_numpy(msg), [1, 2, 3])


def test_non_contiguous_tensor_encodes_its_logical_order():
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    back = proto_to_torch(torch_to_proto(t))
    assert torch.equal(back, t)


def test_numpy_decode_is_zero_copy_and_read_only():
    msg = numpy_to_proto(np.arange(10, dtype=np.int64))
    a = proto_to_numpy(msg)
    assert not a.flags.writeable
    assert not a.flags.owndata  # a view of msg.data, no copy
    with pytest.raises(ValueError):
        a[0] = 1


def test_torch_decode_copy_is_writable_and_independent():
    msg = torch_to_proto(torch.zeros(4))
    t = proto_to_torch(msg)
    t[0] = 5.0
    assert proto_to_torch(msg)[0].item() == 0.0


def test_large_tensor_round_trip():
    n = 64 * 1024 * 1024 // 4 + 3  # just over 64 MiB of fp32
    t = torch.arange(n, dtype=torch.float32)
    msg = torch_to_proto(t)
    assert len(msg.data) == n * 4
    wire = msg.SerializeToString()
    back = proto_to_torch(tensor_pb2.Tensor.FromString(wire), copy=False)
    assert back.shape == (n,) and back[-1].item() == float(n - 1) and torch.equal(back[:1000], t[:1000])
    assert torch.equal(back, t)


def test_byte_length_mismatch_names_shape_and_itemsize():
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[3], data=b"\x00" * 10)
    with pytest.raises(
        TensorDecodeError, match=r"byte length 10 != 12 \(shape \[3\] x itemsize 4 for float32\)"
    ):
        proto_to_torch(msg)
    with pytest.raises(TensorDecodeError, match="byte length"):
        proto_to_numpy(msg)


@pytest.mark.parametrize("dtype", [tensor_pb2.DTYPE_UNSPECIFIED, 99])
def test_unknown_dtype_is_named(dtype):
    msg = tensor_pb2.Tensor(dtype=dtype, shape=[1], data=b"\x00")
    with pytest.raises(TensorDecodeError, match=r"Tensor\.dtype: unknown dtype .*known: float32"):
        proto_to_torch(msg)


def test_negative_dimension_is_named():
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT32, shape=[2, -1], data=b"")
    with pytest.raises(TensorDecodeError, match=r"negative dimension -1 at index 1 in shape \[2, -1\]"):
        proto_to_numpy(msg)


def test_unsupported_types_are_refused_on_encode():
    with pytest.raises(TypeError, match="complex64"):
        torch_to_proto(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="list"):
        to_proto([1, 2])
