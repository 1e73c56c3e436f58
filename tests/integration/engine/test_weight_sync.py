"""Weight sync from a trainer process (this test) to real engine processes over gloo."""

import asyncio
import os
import signal
import subprocess

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

import rlmesh.learner.weight_sync.payload as payload_module
import rlmesh.learner.weight_sync.push as push_module
from rlmesh.engine.client import EngineClient
from rlmesh.learner.weight_sync.push import WeightPusher, WeightPushError
from rlmesh.weights.bucket import flatten_tensors, layout, tensor_views
from tests.support.polling import wait_until
from tests.support.processes import child_env, program
from tests.support.programs import dying_trainer
from tests.support.repo import REPO

PROMPTS = [[10, 20, 30, 40], [5, 6, 7], [80, 81, 82]]
NEW_TOKENS = 8


def greedy_reference(model, prompts):
    """Greedy decoding by full forward passes: what any correct engine must reproduce."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(p) :])
    return outs


def engine_greedy(url):
    body = {
        "input_ids": PROMPTS,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    return [o["output_ids"] for o in httpx.post(url + "/generate", json=body, timeout=120).json()]


@pytest.fixture(scope="module")
def models(tiny_model_dir, other_model_dir):
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    return start, target


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_push_over_gloo_makes_two_engines_produce_the_new_models_greedy_output(
    launcher, tiny_model_dir, models, load_format
):
    """state_dict() lists the tied lm_head.weight too, which the engine's packed layout (parameters
    only) does not hold: with flattened_bucket the buckets before it land straight in the
    parameters, the last goes through a buffer. Both paths must give the new model exactly."""
    start, target = models
    engines = [launcher.start_engine(tiny_model_dir, name=f"push-{load_format}-{i}") for i in range(2)]
    assert all(engine_greedy(e.url) == greedy_reference(start, PROMPTS) for e in engines)
    expected = greedy_reference(target, PROMPTS)
    assert expected != greedy_reference(start, PROMPTS), "the two test models must differ"

    async def push():
        clients = [EngineClient(e.url, timeout_s=120) for e in engines]
        pusher = WeightPusher(
            clients,
            backend="gloo",
            timeout_s=60,
            bucket_bytes=64 << 10,
            load_format=load_format,
            verify_tensors=4,  # checked against each engine after the push: must all agree
        )
        try:
            report = await pusher.push(target.state_dict().items(), version=3)
            mismatches = await pusher.verify(dict(list(target.state_dict().items())[:4]))
            await pusher.close()
            return report, mismatches
        finally:
            for c in clients:
                await c.aclose()

    report, mismatches = asyncio.run(push())
    assert not report.failed and len(report.engines) == 2
    assert report.bytes_per_engine == sum(t.numel() * t.element_size() for t in target.state_dict().values())
    assert all(m == [] for m in mismatches.values())
    for e in engines:
        assert engine_greedy(e.url) == expected
        info = httpx.get(e.url + "/get_model_info").json()
        assert info["weight_version"] == "3"
        direct = httpx.get(e.url + "/get_server_info").json()["weights_direct_updates"]
        assert (direct > 0) == (load_format == "flattened_bucket")
        launcher.stop(e.process)


def test_a_trainer_whose_weights_lie_packed_pushes_them_without_a_copy(
    launcher, tiny_model_dir, models, monkeypatch
):
    """Tensors that are back-to-back views of one buffer (as the learner's push buckets are) are
    broadcast from that buffer itself: the pusher never copies them, and the engine gets them."""
    _, target = models
    named = list(target.state_dict().items())
    tensors = [t for _, t in named]
    dtypes, shapes = [t.dtype for t in tensors], [t.shape for t in tensors]
    offsets, _ = layout(dtypes, shapes)
    packed = list(
        zip(
            [n for n, _ in named],
            tensor_views(flatten_tensors(tensors), offsets, dtypes, shapes),
            strict=True,
        )
    )

    def no_copy(*args, **kwargs):
        raise AssertionError("packed tensors were copied")

    monkeypatch.setattr(payload_module, "flatten_tensors", no_copy)
    engine = launcher.start_engine(tiny_model_dir, name="push-packed")

    async def push():
        client = EngineClient(engine.url, timeout_s=120)
        pusher = WeightPusher([client], backend="gloo", timeout_s=60, bucket_bytes=64 << 10)
        try:
            return await pusher.push(packed, version=4)
        finally:
            await pusher.close()
            await client.aclose()

    report = asyncio.run(push())
    assert not report.failed and report.engines == [engine.url]
    assert engine_greedy(engine.url) == greedy_reference(target, PROMPTS)
    launcher.stop(engine.process)


def test_an_engine_holding_other_values_after_a_push_is_dropped(
    launcher, tiny_model_dir, models, monkeypatch
):
    """The check after a push compares our rows with the engine's own answer; here our record of
    what was sent is made wrong, so the real engine's (correct) values differ from it."""
    _, target = models
    engine = launcher.start_engine(tiny_model_dir, name="checked")
    offer = push_module.VerifySample.offer

    def misrecord(self, bucket):
        offer(self, bucket)
        self.rows = {name: rows + 1.0 for name, rows in self.rows.items()}

    monkeypatch.setattr(push_module.VerifySample, "offer", misrecord)

    async def scenario():
        client = EngineClient(engine.url, name="checked", timeout_s=120)
        pusher = WeightPusher([client], backend="gloo", timeout_s=60, verify_tensors=2)
        try:
            with pytest.raises(WeightPushError) as dropped:
                await pusher.push(target.state_dict().items(), version=1)
            return dropped.value, [link.healthy for link in pusher.links]
        finally:
            await pusher.close()
            await client.aclose()

    dropped, healthy = asyncio.run(scenario())
    assert "after the push it holds other values for model.embed_tokens.weight" in dropped.failed["checked"]
    assert healthy == [False]  # the learner's next push relinks it and pushes afresh
    assert engine_greedy(engine.url) == greedy_reference(target, PROMPTS)  # it did get the weights
    launcher.stop(engine.process)


def test_an_engine_that_refuses_an_update_before_receiving_is_given_up_at_once(
    launcher, tiny_model_dir, models
):
    """The engine answers an update it cannot take (here: a group it does not know) without ever
    receiving, while our broadcast of more bytes than the sockets buffer waits for it: the push
    must fail with the engine's reason now, not with the group's deadline much later. Its next
    push, on a fresh group, lands."""
    _, target = models
    engine = launcher.start_engine(tiny_model_dir, name="refuser")

    async def scenario():
        client = EngineClient(engine.url, name="refuser", timeout_s=120)
        pusher = WeightPusher([client], backend="gloo", timeout_s=600)
        try:
            await pusher.connect()
            pusher.links[0].group.name = "not-a-group"  # the trainer's group stays up, unused
            with pytest.raises(WeightPushError) as refused:
                await pusher.push([("big", torch.ones(8 << 20))], version=1)  # 32 MB
            pusher.set_engines([client])  # as the learner does before every push
            report = await pusher.push(target.state_dict().items(), version=2)
            return refused.value, report
        finally:
            await pusher.close()
            await client.aclose()

    refused, report = asyncio.run(scenario())
    assert "no weight update group 'not-a-group'" in refused.failed["refuser"]
    assert not report.failed and report.engines == ["refuser"]
    assert engine_greedy(engine.url) == greedy_reference(target, PROMPTS)
    launcher.stop(engine.process)


def test_an_unknown_load_format_is_refused_at_once_naming_it(launcher, tiny_model_dir):
    engine = launcher.start_engine(tiny_model_dir, name="bad-format")
    body = {
        "names": ["model.norm.weight"],
        "dtypes": ["float32"],
        "shapes": [[64]],
        "group_name": "weight_update_group",
        "load_format": "direct",
    }
    # No group exists and no broadcast follows: the answer must not wait for one.
    resp = httpx.post(engine.url + "/update_weights_from_distributed", json=body, timeout=10)
    assert resp.status_code == 400
    assert resp.json()["success"] is False and "unknown load_format 'direct'" in resp.json()["message"]
    assert engine_greedy(engine.url)  # still serving
    with pytest.raises(ValueError, match="unknown load_format 'direct'"):
        WeightPusher([], load_format="direct")
    launcher.stop(engine.process)


def test_disk_reload_makes_the_engine_produce_the_new_models_greedy_output(
    launcher, tiny_model_dir, other_model_dir, models
):
    """rlmesh.weight_sync.transport=disk: the learner's path, WeightPusher.load_from_disk."""
    _, target = models
    engine = launcher.start_engine(tiny_model_dir, name="disk")
    expected = greedy_reference(target, PROMPTS)

    async def load(path, version):
        client = EngineClient(engine.url, name="disk")
        pusher = WeightPusher([client])
        try:
            return await pusher.load_from_disk(path, version)
        finally:
            await pusher.close()
            await client.aclose()

    report = asyncio.run(load(str(other_model_dir), 9))
    assert not report.failed and report.engines == ["disk"]
    assert engine_greedy(engine.url) == expected
    assert httpx.get(engine.url + "/get_model_info").json()["weight_version"] == "9"
    with pytest.raises(
        WeightPushError, match=r"disk: update_weights_from_disk: .*no safetensors file at /nonexistent"
    ):
        asyncio.run(load("/nonexistent", 10))
    # The engine that failed stays paused until an update to it succeeds; that one changes nothing
    # here, so its answers are the same: a failed load changed nothing.
    assert not asyncio.run(load(str(other_model_dir), 11)).failed
    assert engine_greedy(engine.url) == expected
    launcher.stop(engine.process)


def test_a_replica_killed_during_a_push_fails_fast_and_the_survivors_get_the_next_push(
    launcher, tiny_model_dir, models
):
    start, target = models
    survivor = launcher.start_engine(tiny_model_dir, name="survivor")
    doomed = launcher.start_engine(tiny_model_dir, name="doomed")

    async def scenario():
        clients = [
            EngineClient(survivor.url, name="survivor", timeout_s=120),
            EngineClient(doomed.url, name="doomed", timeout_s=120),
        ]
        pusher = WeightPusher(clients, backend="gloo", timeout_s=60, bucket_bytes=16 << 10)
        buckets_done = []

        def kill_after_first_bucket(n_tensors, sent):
            buckets_done.append(sent)
            if len(buckets_done) == 1:
                os.kill(doomed.process.pid, signal.SIGKILL)

        try:
            first = await pusher.push(
                target.state_dict().items(), version=1, on_bucket=kill_after_first_bucket
            )
            assert len(buckets_done) > 2, "the push must span several buckets for this test"
            second = await pusher.push(start.state_dict().items(), version=2)
            return first, second, [link.name for link in pusher.healthy_links]
        finally:
            await pusher.close()
            for c in clients:
                await c.aclose()

    first, second, healthy = asyncio.run(scenario())
    assert list(first.failed) == ["doomed"] and first.engines == ["survivor"]
    assert "doomed" in str(WeightPushError(first.failed))
    assert healthy == ["survivor"]
    assert second.engines == ["survivor"] and not second.failed
    assert engine_greedy(survivor.url) == greedy_reference(start, PROMPTS)
    launcher.stop(survivor.process)


def test_a_trainer_dying_midway_holds_generation_until_a_complete_push(launcher, tiny_model_dir, models):
    _, target = models
    engine = launcher.start_engine(tiny_model_dir, name="trainer-dies")
    proc = subprocess.run(
        program("dying_trainer", engine.url, tiny_model_dir),
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == dying_trainer.EXIT_CODE, proc.stderr[-3000:]
    wait_until(
        lambda: httpx.get(engine.url + "/get_server_info").json()["weights_tainted"] > 0,
        60,
        "the engine to notice the sender is gone",
    )
    held = httpx.get(engine.url + "/health_generate", timeout=30)
    assert held.status_code == 503 and "half written" in held.text
    assert httpx.get(engine.url + "/get_model_info").json()["weight_version"] != "9"

    async def full_push():
        client = EngineClient(engine.url, timeout_s=60)
        pusher = WeightPusher([client], backend="gloo", timeout_s=60)
        try:
            report = await pusher.push(list(target.named_parameters()), version=10)
            await pusher.close()
            return report
        finally:
            await client.aclose()

    report = asyncio.run(full_push())  # a new trainer: its group replaces the dead one's
    assert not report.failed and len(report.engines) == 1
    info = httpx.get(engine.url + "/get_server_info").json()
    assert info["weights_tainted"] == 0 and info["weights_direct_updates"] >= 1
    assert httpx.get(engine.url + "/health_generate", timeout=30).status_code == 200
    assert engine_greedy(engine.url) == greedy_reference(target, PROMPTS)
    launcher.stop(engine.process)


def test_an_engine_cut_off_costs_a_push_the_control_timeout_not_the_push_timeout(
    launcher, tiny_model_dir, models
):
    """One engine is reached through a proxy that stops forwarding (a partition: silence, no
    reset). The push timeout is 300 s; the control calls' is 2 s: the push with the engine cut off
    drops it after that, the other engine gets the weights, a relink fails as fast, and once the
    network heals the next push reaches it again."""
    from tests.support.netproxy import PartitionableProxy

    start, target = models
    near = launcher.start_engine(tiny_model_dir, name="near")
    far = launcher.start_engine(tiny_model_dir, name="far")
    port = int(far.url.rsplit(":", 1)[1])
    proxy = PartitionableProxy("127.0.0.1", port)

    async def scenario():
        clients = [
            EngineClient(near.url, name="near", timeout_s=300),
            EngineClient(f"http://{proxy.address}", name="far", timeout_s=300),
        ]
        pusher = WeightPusher(clients, backend="gloo", timeout_s=300, control_timeout_s=2)
        reports = []
        try:
            reports.append(await pusher.push(start.state_dict().items(), version=1))
            proxy.partition()
            reports.append(await pusher.push(target.state_dict().items(), version=2))
            pusher.set_engines(clients)  # as the learner does before every push: "far" is relinked
            reports.append(await pusher.push(target.state_dict().items(), version=3))
            proxy.heal()
            pusher.set_engines(clients)
            reports.append(await pusher.push(target.state_dict().items(), version=4))
            return reports
        finally:
            await pusher.close()
            for c in clients:
                await c.aclose()

    try:
        first, cut, relink, healed = asyncio.run(scenario())
    finally:
        proxy.close()
    assert not first.failed
    assert cut.failed == {"far": "pause_generation: no answer within 2 s"}
    assert "/health did not answer within 2 s" in relink.failed["far"]
    assert not healed.failed and sorted(healed.engines) == ["far", "near"]
    assert engine_greedy(near.url) == engine_greedy(far.url) == greedy_reference(target, PROMPTS)
    launcher.stop(near.process)
    launcher.stop(far.process)
