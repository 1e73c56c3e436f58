"""Which engine clients the pusher keeps and which it hands back to be closed; bucket order."""

import pytest
import torch

from rlmesh.engine.client import EngineClient, engine_device_of
from rlmesh.learner.weight_sync.links import EngineLink, WeightGroup, partition, weight_sync_backend
from rlmesh.learner.weight_sync.payload import aligned
from rlmesh.learner.weight_sync.push import WeightPusher, whole_groups
from rlmesh.learner.weight_sync.verify import VERIFY_ROWS, VerifySample, same_values
from rlmesh.weights.bucket import layout


def test_a_failed_engine_listed_again_with_the_same_client_keeps_it_open():
    a, b = EngineClient("http://127.0.0.1:1"), EngineClient("http://127.0.0.1:2")
    pusher = WeightPusher([a, b])
    pusher.links[0].healthy = False  # its last push failed
    unused = pusher.set_engines([a, b])  # the learner lists the live replicas with the clients it has
    assert unused == []  # closing ``a`` here would leave its fresh link with a closed client
    assert [link.client for link in pusher.links] == [a, b] and all(link.healthy for link in pusher.links)


def test_clients_of_engines_gone_or_replaced_are_handed_back():
    a, b, a2 = (
        EngineClient("http://127.0.0.1:1"),
        EngineClient("http://127.0.0.1:2"),
        EngineClient("http://127.0.0.1:1"),
    )
    pusher = WeightPusher([a, b])
    pusher.links[0].healthy = False
    unused = pusher.set_engines([a2])
    assert set(map(id, unused)) == {id(a), id(b)}
    assert [link.client for link in pusher.links] == [a2]


def test_group_names_differ_between_pushers():
    assert WeightPusher([]).group_prefix != WeightPusher([]).group_prefix


def test_an_engine_whose_rank_count_changed_gets_a_fresh_link():
    a, b = EngineClient("http://127.0.0.1:1"), EngineClient("http://127.0.0.1:2")
    pusher = WeightPusher([a, b])
    kept = pusher.links[1]
    assert pusher.set_engines([a, b], ranks=[2, 1]) == []
    assert [link.ranks for link in pusher.links] == [2, 1]
    assert pusher.links[1] is kept  # same ranks: same link and group
    assert pusher.set_engines([a, b]) == [] and [link.ranks for link in pusher.links] == [1, 1]


class _ProcessGroup:
    """Stands for a process group where nothing is sent: records its shutdown."""

    def __init__(self, group):
        self.group = group

    def shutdown(self):
        self.group.shut_down = True


def _grouped(links):
    """Puts ``links`` in one group, as a connect would, with a stand-in process group."""
    group = WeightGroup("g", links[0].backend, list(links))
    group.pg, group.shut_down = _ProcessGroup(group), False
    for link in links:
        link.group = group
    return group


def test_engines_are_grouped_by_backend_in_their_order_up_to_group_size():
    backends = ["gloo", "gloo", "nccl", "gloo", "gloo", "gloo"]
    links = [EngineLink(EngineClient(f"http://127.0.0.1:{i}"), backend=b) for i, b in enumerate(backends, 1)]
    ports = [[int(link.client.url.rsplit(":", 1)[1]) for link in g] for g in partition(links, 2)]
    assert ports == [[1, 2], [4, 5], [6], [3]]
    assert [len(g) for g in partition(links, 1)] == [1] * 6
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        WeightPusher([], group_size=0)


def test_a_group_gives_each_member_the_ranks_after_the_ones_before_it():
    links = [EngineLink(EngineClient(f"http://127.0.0.1:{i}"), ranks=r) for i, r in enumerate([2, 1, 4], 1)]
    group = _grouped(links)
    assert group.world_size == 8 and [group.rank_offset(link) for link in links] == [1, 3, 4]


def test_a_group_that_loses_a_member_is_dropped_for_all_and_a_push_takes_whole_groups():
    a, b, c = (EngineClient(f"http://127.0.0.1:{i}", name=n) for i, n in zip((1, 2, 3), "abc", strict=True))
    pusher = WeightPusher([a, b, c], group_size=2)
    _grouped(pusher.links[:2])
    _grouped(pusher.links[2:])
    assert [link.name for link in pusher._targets({b.url})] == ["a", "b"]  # b's group whole
    failed = {"a": "pause_generation: refused"}
    assert [link.name for link in whole_groups(pusher.links, failed)] == ["c"]
    assert failed["b"] == "another engine of its weight group failed: a"
    pusher.links[1].group.pg = None  # not a real group: nothing to destroy
    pusher.set_engines([b, c])  # a left the registry
    assert [(link.name, link.group) for link in pusher.links[:1]] == [("b", None)]
    assert pusher.links[1].group is not None  # c's group had no member leave


def test_a_push_to_all_merges_groups_that_churn_left_small():
    clients = [EngineClient(f"http://127.0.0.1:{i}", name=f"e{i}") for i in range(1, 6)]
    pusher = WeightPusher(clients, group_size=4)
    whole, lone_a, lone_b = (
        _grouped(pusher.links[:3]),
        _grouped(pusher.links[3:4]),
        _grouped(pusher.links[4:]),
    )
    pusher._groups = [whole, lone_a, lone_b]
    pusher._merge_fragments()
    # The two groups of one are dropped (their members grouped afresh by the connect); 3 of 4 stays.
    assert [link.group for link in pusher.links[3:]] == [None, None]
    assert lone_a.shut_down and lone_b.shut_down and not whole.shut_down
    assert all(link.group is whole for link in pusher.links[:3])

    single = WeightPusher(clients[:2])  # group_size 1: every group has one engine, by design
    single._groups = [_grouped(single.links[:1]), _grouped(single.links[1:])]
    single._merge_fragments()
    assert all(link.group is not None for link in single.links)


def test_buckets_are_ordered_so_that_every_tensor_is_aligned_once_flattened():
    bucket = [
        ("a", torch.zeros(3, dtype=torch.bfloat16)),  # 6 bytes: a float32 after it would sit at 6
        ("b", torch.zeros(2)),
        ("c", torch.zeros(1, dtype=torch.int64)),
        ("d", torch.zeros(5, dtype=torch.bool)),
        ("e", torch.zeros(1)),
    ]
    ordered = aligned(bucket)
    assert [n for n, _ in ordered] == ["c", "b", "e", "a", "d"]  # by element size, else in order
    offsets, _ = layout([t.dtype for _, t in ordered], [t.shape for _, t in ordered])
    assert all(o % t.element_size() == 0 for o, (_, t) in zip(offsets, ordered, strict=True))
    same = [(f"w{i}", torch.zeros(i + 1)) for i in range(4)]
    assert aligned(same) == same  # one dtype: the order the engine's packed layout expects


def test_checked_tensors_are_spread_over_the_push_and_compared_at_the_engines_precision():
    named = [(f"t{i}", torch.full((10, 3), float(i))) for i in range(12)]
    first = VerifySample(4, tensors_last_push=0)  # first push: the first ones
    first.offer(named[:5])
    first.offer(named[5:])
    assert list(first.rows) == ["t0", "t1", "t2", "t3"] and first.seen == 12
    spread = VerifySample(4, tensors_last_push=first.seen)
    spread.offer(named)
    assert list(spread.rows) == ["t0", "t3", "t6", "t9"]
    assert spread.rows["t3"].shape == (VERIFY_ROWS, 3)
    assert VerifySample(0, 12).rows == {}

    ours = torch.tensor([1.0, 1 / 3, 2.0 + 2**-10])
    assert same_values(ours, ours.clone())
    assert same_values(ours, ours.to(torch.bfloat16).float())  # an engine holding bf16
    assert same_values(ours, ours.to(torch.float16).float())
    assert not same_values(ours, ours + 1e-3)
    assert not same_values(ours, ours[:2])


def test_an_engine_whose_backend_changed_gets_a_fresh_link():
    a, b = EngineClient("http://127.0.0.1:1"), EngineClient("http://127.0.0.1:2")
    pusher = WeightPusher([a, b])
    kept = pusher.links[0]
    pusher.set_engines([a, b], backends=["gloo", "nccl"])
    assert [link.backend for link in pusher.links] == ["gloo", "nccl"]
    assert pusher.links[0] is kept and pusher.links[1].pg is None


@pytest.mark.parametrize(
    ("configured", "trainer", "engine", "backend"),
    [
        ("auto", "cuda", "cuda", "nccl"),
        ("auto", "cuda", "cpu", "gloo"),  # an embedded CPU engine beside a GPU learner
        ("auto", "cpu", "cuda", "gloo"),  # trainer.device=cpu beside an SGLang replica
        ("auto", "cpu", "cpu", "gloo"),
        ("auto", "cuda", "xpu", "gloo"),
        ("gloo", "cuda", "cuda", "gloo"),  # set by the user: as set
        ("nccl", "cpu", "cpu", "nccl"),
    ],
)
def test_the_weight_group_is_nccl_only_when_both_ends_are_on_cuda(configured, trainer, engine, backend):
    assert weight_sync_backend(configured, trainer, engine) == backend


@pytest.mark.parametrize(
    ("kind", "info", "device"),
    [
        ("embedded", {"engine": "embedded", "device": "cpu"}, "cpu"),
        ("embedded", {}, "cpu"),
        ("sglang", {"device": "cuda"}, "cuda"),
        ("sglang", {"device": "cuda:1"}, "cuda"),
        ("sglang", {"device": "cpu"}, "cpu"),  # SGLang's CPU backend
        ("sglang", {}, "cuda"),  # a server that names none: SGLang's default
    ],
)
def test_the_engine_device_comes_from_its_server_info(kind, info, device):
    assert engine_device_of(kind, info) == device
