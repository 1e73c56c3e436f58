"""Weight groups shared by several engines (``group_size`` > 1): one broadcast per group reaches
every member, real engine processes over gloo; a member's death spends its group's push only."""

import asyncio
import contextlib
import os
import signal
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.engine.client import EngineClient
from rlmesh.learner.weight_sync.push import WeightPusher, WeightPushError
from tests.integration.engine.test_weight_sync import PROMPTS, engine_greedy, greedy_reference


@pytest.fixture(scope="module")
def models(tiny_model_dir, other_model_dir):
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    return start, target


@pytest.fixture(scope="module")
def three(launcher, tiny_model_dir):
    """Three engines the tests share (each push reaches them all before a test checks them)."""
    return [launcher.start_engine(tiny_model_dir, name=f"shared-{i}") for i in range(3)]


def _clients(engines):
    return [EngineClient(e.url, name=name, timeout_s=120) for name, e in engines.items()]


@contextlib.asynccontextmanager
async def pushing(engines, **settings):
    """A pusher over gloo to ``engines`` (name -> engine) and its clients, closed after."""
    clients = _clients(engines)
    pusher = WeightPusher(clients, backend="gloo", **settings)
    try:
        yield clients, pusher
    finally:
        await pusher.close()
        for c in clients:
            await c.aclose()


def _groups(pusher):
    """Each group's members, by name, and the rank each was given, as the pusher holds them."""
    seen = {}
    for link in pusher.links:
        if link.group is not None:
            seen[id(link.group)] = link.group
    return [[(m.name, g.rank_offset(m)) for m in g.members] for g in seen.values()]


def test_engines_sharing_groups_all_take_a_push_and_a_group_is_at_most_group_size(three, models):
    _, target = models
    engines = {f"e{i}": e for i, e in enumerate(three)}

    async def scenario():
        settings = {"timeout_s": 120, "bucket_bytes": 16 << 10, "group_size": 2, "load_format": "auto"}
        async with pushing(engines, **settings) as (_, pusher):
            report = await pusher.push(target.state_dict().items(), version=1)
            return report, _groups(pusher), {link.name: link.load_format for link in pusher.links}

    report, groups, formats = asyncio.run(scenario())
    assert sorted(report.engines) == ["e0", "e1", "e2"] and not report.failed
    # Three engines in groups of at most two: two groups, ranks from 1 up within each.
    assert groups == [[("e0", 1), ("e1", 2)], [("e2", 1)]]
    # load_format=auto: tensor by tensor to the gloo group of two, one flattened bucket to the lone one.
    assert formats == {"e0": None, "e1": None, "e2": "flattened_bucket"}
    expected = greedy_reference(target, PROMPTS)
    for e in engines.values():
        assert engine_greedy(e.url) == expected


def test_a_member_killed_mid_push_fails_its_group_and_the_survivors_regroup_for_the_next(
    launcher, tiny_model_dir, three, models
):
    start, target = models
    engines = {
        "a": three[0],
        "doomed": launcher.start_engine(tiny_model_dir, name="doomed"),
        "b": three[1],
        "alone": three[2],
    }

    async def scenario():
        async with pushing(engines, timeout_s=120, bucket_bytes=16 << 10, group_size=3) as (clients, pusher):
            buckets_done = []

            def kill_after_first_bucket(n_tensors, sent):
                buckets_done.append(sent)
                if len(buckets_done) == 1:
                    os.kill(engines["doomed"].process.pid, signal.SIGKILL)

            first = await pusher.push(
                target.state_dict().items(), version=1, on_bucket=kill_after_first_bucket
            )
            assert len(buckets_done) > 2, "the push must span several buckets for this test"
            # The registry no longer lists the dead one; the others are listed again.
            pusher.set_engines([c for c in clients if c.name != "doomed"])
            second = await pusher.push(start.state_dict().items(), version=2)
            return first, second, _groups(pusher)

    first, second, groups = asyncio.run(scenario())
    # The dead member spent its group: every member of it failed this push; the engine alone in
    # the other group took it.
    assert sorted(first.failed) == ["a", "b", "doomed"] and first.engines == ["alone"]
    assert first.failed["a"] == first.failed["b"]  # one cause: doomed's refusal or the broken broadcast
    assert sorted(second.engines) == ["a", "alone", "b"] and not second.failed
    # The survivors of the spent group are grouped afresh, and the engine alone (a group under half
    # the size) joins them: churn does not leave fragments.
    assert groups == [[("a", 1), ("b", 2), ("alone", 3)]]
    expected = greedy_reference(start, PROMPTS)
    for name in ("a", "b", "alone"):
        assert engine_greedy(engines[name].url) == expected


def test_a_push_to_some_engines_reaches_every_member_of_their_groups(three, models):
    start, target = models
    engines = {f"o{i}": e for i, e in enumerate(three)}

    async def scenario():
        async with pushing(engines, timeout_s=120, group_size=2) as (clients, pusher):
            await pusher.push(start.state_dict().items(), version=1)
            only = {engines["o0"].url.rstrip("/")}
            report = await pusher.push(target.state_dict().items(), version=2, only=only)
            versions = {c.name: (await c.model_info())["weight_version"] for c in clients}
            return report, versions

    report, versions = asyncio.run(scenario())
    # o0 shares its group with o1: a broadcast reaches a group whole, so o1 takes it too; o2 not.
    assert sorted(report.engines) == ["o0", "o1"]
    assert versions == {"o0": "2", "o1": "2", "o2": "1"}
    assert engine_greedy(engines["o1"].url) == greedy_reference(target, PROMPTS)
    assert engine_greedy(engines["o2"].url) == greedy_reference(start, PROMPTS)


def test_an_engine_waiting_in_a_group_rendezvous_still_stops_on_sigterm(launcher, tiny_model_dir):
    """As when another member of its group never joins: the engine's join waits for its deadline
    (the engine's default, 600 s), and SIGTERM must still stop it within the launcher's grace (10 s),
    exit code 0."""
    engine = launcher.start_engine(tiny_model_dir, name="waiting")
    listen = socket.create_server(("127.0.0.1", 0))  # a rendezvous that takes connections, answers none

    async def join_never_completed():
        client = EngineClient(engine.url, name="waiting", timeout_s=600)
        try:
            return await client.init_weights_update_group(
                "127.0.0.1", listen.getsockname()[1], 1, 3, "g", "gloo"
            )
        finally:
            await client.aclose()

    async def scenario():
        joining = asyncio.create_task(join_never_completed())
        # The engine has taken the call once the rendezvous dialled us.
        await asyncio.get_running_loop().run_in_executor(None, listen.accept)
        code = await asyncio.to_thread(launcher.stop, engine.process, 10)
        joining.cancel()
        return code

    try:
        assert asyncio.run(scenario()) == 0
    finally:
        listen.close()


def test_a_member_that_lost_its_group_refuses_and_the_members_below_it_are_not_held(three, models):
    """As an engine restarted at its URL would: it no longer knows the group and refuses the update
    before receiving. The member that receives from it in gloo's tree (with 4 ranks, rank 3 from
    rank 1) finds its connection closed and fails at once, so the next push reaches every engine
    (held in a receive until the group's deadline, it would not: its update holds the engine)."""
    start, target = models
    engines = {f"r{i}": e for i, e in enumerate(three)}

    async def scenario():
        async with pushing(engines, timeout_s=600, group_size=3) as (clients, pusher):
            await pusher.connect()
            assert _groups(pusher) == [[("r0", 1), ("r1", 2), ("r2", 3)]]
            await clients[0].destroy_weights_update_group(pusher.links[0].group_name)
            with pytest.raises(WeightPushError) as refused:
                await pusher.push(start.state_dict().items(), version=1)
            pusher.set_engines(clients)  # listed again by the registry
            return refused.value.failed, await pusher.push(target.state_dict().items(), version=2)

    refused, second = asyncio.run(scenario())
    # Which failure the learner sees first is a race: r0's refusal, or the closed connection r0 left
    # in the broadcast (r2's, below it in gloo's tree); the other members name those that failed.
    assert sorted(refused) == ["r0", "r1", "r2"]
    followed = "another engine of its weight group failed: "
    first = {n: m for n, m in refused.items() if not m.startswith(followed)}
    assert first, refused
    for m in first.values():
        assert (
            "no weight update group" in m
            or m.startswith("RuntimeError: ")
            or "Connection closed by peer" in m
        ), refused
    for name, m in refused.items():
        assert name in first or set(m.removeprefix(followed).split(", ")) <= set(first), refused
    assert sorted(second.engines) == ["r0", "r1", "r2"] and not second.failed
    expected = greedy_reference(target, PROMPTS)
    for e in engines.values():
        assert engine_greedy(e.url) == expected
