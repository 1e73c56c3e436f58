"""The reference service as a real process on loopback: log-probs equal a direct forward, malformed
requests get INVALID_ARGUMENT naming the problem, and a config without a reference model."""

import asyncio
import itertools
import random
import time

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.config import load_config
from rlmesh.job.report import metric_sum
from rlmesh.reference import ReferenceClient
from rlmesh.runtime.balancer import ServiceCallError
from rlmesh.runtime.busy import union_seconds
from rlmesh.runtime.health import scrape_metrics
from rlmesh.runtime.launcher import LaunchError, ProcessLauncher
from rlmesh.v1 import reference_pb2, reference_pb2_grpc

PORTS = ["rlmesh.reference.port=0", "rlmesh.reference.metrics_port=0"]


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("reference-svc"), stop_grace_s=10) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def reference(launcher, tiny_model_dir):
    return launcher.start_service(
        "reference",
        overrides=[
            *PORTS,
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "rlmesh.reference.max_tokens=128",
            "rlmesh.reference.max_batch_size=16",
        ],
    )


def direct(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    return logprobs[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt) :]].tolist()


def s(uid, prompt, response):
    return reference_pb2.LogProbsSample(uid=uid, prompt_ids=prompt, response_ids=response)


async def test_log_probs_equal_a_direct_computation(reference, tiny_model_dir):
    rng = random.Random(7)
    samples = [
        s(
            f"u{i}",
            [rng.randrange(100) for _ in range(rng.randint(1, 50))],
            [rng.randrange(100) for _ in range(rng.randint(1, 40))],
        )
        for i in range(12)
    ]
    async with ReferenceClient([reference.grpc_address], timeout_s=60) as client:
        info = await client.info()
        assert info.vocab_size == 100 and info.dtype == "float32" and info.max_tokens_per_batch == 128
        assert info.max_batch_size == 16 and info.model_path == str(tiny_model_dir)
        results = await client.log_probs(samples)
        plain = await client.log_probs_of([[1, 2, 3]], [[4, 5]])
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    assert [r.uid for r in results] == [x.uid for x in samples]
    for sample, result in zip(samples, results, strict=True):
        assert not result.HasField("error")
        assert list(result.log_probs) == pytest.approx(
            direct(model, list(sample.prompt_ids), list(sample.response_ids)), abs=1e-5
        )
    assert plain[0] == pytest.approx(direct(model, [1, 2, 3], [4, 5]), abs=1e-5)
    metrics = scrape_metrics(reference.grpc_address.rsplit(":", 1)[0], reference.metrics_port)
    forwards = next(
        ln for ln in metrics.splitlines() if ln.startswith("rlmesh_reference_micro_batches_total")
    )
    assert float(forwards.split()[-1]) > 2  # 12 samples of up to 90 tokens cannot share 128-token forwards


async def test_get_info_and_metrics_say_when_the_forwards_ran(reference):
    prompt, response = list(range(1, 60)), list(range(60, 99))
    async with ReferenceClient([reference.grpc_address], timeout_s=60) as client:
        before = await client.info()
        t0 = time.time()
        # Concurrent calls queue for the model: their busy time counts once, not per call.
        await asyncio.gather(*(client.log_probs_of([prompt] * 8, [response] * 8) for _ in range(4)))
        t1 = time.time()
        after = await client.info()
    flat = list(after.busy_intervals)
    assert len(flat) % 2 == 0
    intervals = list(zip(flat[::2], flat[1::2], strict=True))
    assert all(a <= b for a, b in intervals)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(intervals))  # disjoint, in order
    busy = after.busy_s - before.busy_s
    assert 0 < busy <= t1 - t0
    # Intervals bridge the sub-millisecond gaps between queued calls; busy_s does not.
    assert union_seconds([intervals], t0, t1) == pytest.approx(busy, abs=0.01)
    metrics = scrape_metrics(reference.grpc_address.rsplit(":", 1)[0], reference.metrics_port)
    line = next(ln for ln in metrics.splitlines() if ln.startswith("rlmesh_reference_busy_seconds_total"))
    assert float(line.split()[-1]) >= after.busy_s


async def test_metrics_count_log_probs_calls_and_their_samples(reference):
    def counts():
        text = scrape_metrics(reference.grpc_address.rsplit(":", 1)[0], reference.metrics_port)
        return (
            metric_sum(text, "rlmesh_rpc_requests_total", method="/rlmesh.v1.Reference/LogProbs"),
            metric_sum(text, "rlmesh_reference_batch_size_count"),
            metric_sum(text, "rlmesh_reference_batch_size_sum"),
        )

    rpcs, calls, samples = counts()
    async with ReferenceClient([reference.grpc_address], timeout_s=60) as client:
        await client.log_probs_of([[1, 2, 3]] * 5, [[4, 5]] * 5)
        await client.log_probs_of([[1, 2]], [[3]])
    assert counts() == (rpcs + 2, calls + 2, samples + 6)


async def test_malformed_requests_get_invalid_argument_naming_the_problem(reference):
    cases = {
        "empty batch": [],
        "batch of 17 samples is over this service's max_batch_size of 16": [
            s(str(i), [1], [2]) for i in range(17)
        ],
        "sample 1 (uid 'big'): response_ids holds token id 100, not below the vocabulary size 100": [
            s("ok", [1], [2]),
            s("big", [1], [3, 100]),
        ],
        "sample 0 (uid 'neg'): prompt_ids holds a negative token id -1": [s("neg", [-1], [2])],
        "sample 0 (uid 'np'): prompt_ids is empty": [s("np", [], [2])],
        "sample 0 (uid 'nr'): response_ids is empty": [s("nr", [1], [])],
        "sample 0 (uid 'long'): 100 prompt + 50 response tokens = 150, over the token budget per forward of 128": [
            s("long", [1] * 100, [2] * 50)
        ],
    }
    async with grpc.aio.insecure_channel(reference.grpc_address) as channel:
        stub = reference_pb2_grpc.ReferenceStub(channel)
        for message, samples in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.LogProbs(reference_pb2.LogProbsRequest(samples=samples), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details(), err.value.details()


async def test_without_a_model_the_service_starts_only_when_no_kl_needs_it(launcher, tmp_path):
    missing = tmp_path / "no-model"
    idle = launcher.start_service(
        "reference", name="reference-idle", overrides=[*PORTS, f"actor_rollout_ref.model.path={missing}"]
    )
    cfg = load_config(
        None, [f"rlmesh.reference.addresses={idle.grpc_address}", "rlmesh.reference.timeout_s=10"]
    )
    async with ReferenceClient.from_config(cfg) as client:
        assert (await client.info()).vocab_size == 0
        with pytest.raises(ServiceCallError) as err:
            await client.log_probs([s("a", [1], [2])])
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "does not exist" in err.value.details
    with pytest.raises(LaunchError) as err:
        launcher.start_service(
            "reference",
            name="reference-needed",
            overrides=[
                *PORTS,
                f"actor_rollout_ref.model.path={missing}",
                "actor_rollout_ref.actor.use_kl_loss=true",
            ],
            timeout_s=60,
        )
    assert (
        "exited with code 2" in str(err.value)
        and "use_kl_loss" in str(err.value)
        and str(missing) in str(err.value)
    )
