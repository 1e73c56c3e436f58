"""The flattened_bucket layout (SGLang's ``load_format``) and the engine's receive over real gloo."""

import subprocess

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rlmesh.engine.weight_updates import EngineWeights, WeightUpdateError
from rlmesh.runtime.net import free_port
from rlmesh.weights.bucket import flatten_tensors, layout, packed_bytes, tensor_views, unflatten_tensors
from tests.support.processes import child_env, program
from tests.support.programs.bucket_sender import ROUNDS, payload
from tests.support.repo import REPO


def mixed_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),  # float32, 60 bytes
        torch.randn(7, generator=g).to(torch.bfloat16),  # 14 bytes: what follows is misaligned
        torch.randint(-(2**40), 2**40, (2, 3), generator=g),  # int64 at offset 74
        torch.tensor(2.5),  # 0-dim float32
        torch.empty(0, 4),  # no bytes
        torch.randn(4, 6, generator=g).t(),  # not contiguous
        torch.tensor([True, False, True]),
        torch.randn(2, 2, generator=g).to(torch.float16),
    ]


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_a_mixed_dtype_bucket_round_trips_exactly():
    tensors = mixed_tensors()
    flat = flatten_tensors(tensors)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert flat.numel() == sum(t.numel() * t.element_size() for t in tensors)
    # SGLang's layout: each tensor's bytes back to back, in order, no padding.
    assert torch.equal(flat, torch.cat([bytes_of(t) for t in tensors]))
    back = unflatten_tensors(flat, [t.dtype for t in tensors], [t.shape for t in tensors])
    for sent, got in zip(tensors, back, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(bytes_of(got), bytes_of(sent))  # bit for bit
        assert torch.equal(got, sent)


def test_unflatten_gives_views_where_aligned_and_rejects_a_wrong_size():
    tensors = [torch.randn(4), torch.randn(2, 2).to(torch.bfloat16), torch.arange(3)]
    flat = flatten_tensors(tensors)
    a, b, c = unflatten_tensors(flat, [t.dtype for t in tensors], [t.shape for t in tensors])
    assert a.data_ptr() == flat.data_ptr() and b.data_ptr() == flat.data_ptr() + 16
    assert c.data_ptr() == flat.data_ptr() + 24
    with pytest.raises(ValueError, match="24 uint8 bytes"):
        unflatten_tensors(flat[:-1], [t.dtype for t in tensors[:2]], [t.shape for t in tensors[:2]])


def test_flatten_reuses_a_big_enough_buffer():
    tensors = [torch.randn(10), torch.randn(3).to(torch.bfloat16)]
    spare = torch.empty(1000, dtype=torch.uint8)
    flat = flatten_tensors(tensors, out=spare)
    assert flat.data_ptr() == spare.data_ptr() and flat.numel() == 46
    assert flatten_tensors(tensors, out=torch.empty(10, dtype=torch.uint8)).numel() == 46  # too small: new


def test_tensors_already_packed_are_their_own_bucket_without_a_copy():
    tensors = mixed_tensors()
    buffer = flatten_tensors(tensors)
    offsets, _ = layout([t.dtype for t in tensors], [t.shape for t in tensors])
    views = tensor_views(buffer, offsets, [t.dtype for t in tensors], [t.shape for t in tensors])
    # Views of the front of one storage, back to back: the bucket is those very bytes.
    front = views[:2]
    packed = packed_bytes(front)
    assert packed is not None and packed.data_ptr() == buffer.data_ptr()
    assert torch.equal(packed, flatten_tensors(front))
    # The same views from a storage offset: still one run.
    inner = [torch.arange(6.0), torch.arange(4.0)]
    backing = torch.cat([torch.zeros(3), *inner])
    run = [backing[3:9], backing[9:13].view(2, 2)]
    got = packed_bytes(run)
    assert got is not None and torch.equal(got, flatten_tensors(inner))
    assert got.data_ptr() == backing[3:].data_ptr()
    # Anything else needs the copy: separate tensors, a gap, a wrong order, not contiguous,
    # another device than asked for.
    assert packed_bytes([torch.zeros(2), torch.zeros(2)]) is None
    assert packed_bytes([backing[0:2], backing[3:5]]) is None
    assert packed_bytes([backing[2:4], backing[0:2]]) is None
    assert packed_bytes([backing[:12].view(3, 4).t()]) is None
    assert packed_bytes(run, device="meta") is None
    assert packed_bytes([]) is None


def test_layout_aligns_when_asked():
    dtypes, shapes = [torch.bfloat16, torch.float32, torch.int64], [[3], [1], [2]]
    assert layout(dtypes, shapes) == ([0, 6, 10], 26)
    assert layout(dtypes, shapes, align=64) == ([0, 64, 128], 144)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3, 5))
        self.b = nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))
        self.register_buffer("c", torch.zeros(2, 3, dtype=torch.int64))
        self.d = nn.Parameter(torch.zeros(2, 2, dtype=torch.float16))


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_the_engine_receives_a_mixed_dtype_bucket_over_gloo(load_format):
    weights = EngineWeights(Tiny())
    port = free_port()
    group = f"bucket_test_{load_format}"
    sender = subprocess.Popen(program("bucket_sender", port, group, load_format), cwd=REPO, env=child_env())
    try:
        weights.init_group("127.0.0.1", port, 1, 2, group, "gloo", 60.0)
        first = payload(0)
        names = list(first)
        dtypes = [str(t.dtype).removeprefix("torch.") for t in first.values()]
        shapes = [list(t.shape) for t in first.values()]
        buffers = []
        for round_ in range(ROUNDS):  # the second update reuses the first one's buffer
            with weights.receiving(names, dtypes, shapes, group, load_format) as got:
                buffers.append(got["a"].untyped_storage().data_ptr())
                weights.load(got, strict=True)
            for name, t in payload(round_).items():
                assert torch.equal(weights.params()[name], t), name
        assert buffers[0] == buffers[1]
        dist.barrier(group=weights.groups[group])
        weights.destroy_group(group)
        assert sender.wait(30) == 0
    finally:
        sender.kill()
        if group in weights.groups:
            weights.destroy_group(group)


def test_the_engine_names_an_unknown_load_format_before_touching_the_group():
    weights = EngineWeights(Tiny())
    with pytest.raises(WeightUpdateError, match="unknown load_format 'bucket'"):
        weights.receive(["a"], ["float32"], [[3, 5]], "no-such-group", "bucket")
