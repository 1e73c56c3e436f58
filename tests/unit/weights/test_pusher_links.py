"""Which engine clients the pusher keeps and which it hands back to be closed."""

from rlmesh.engine.client import EngineClient
from rlmesh.weights.push import WeightPusher


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
