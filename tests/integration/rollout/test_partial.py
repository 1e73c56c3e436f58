"""Partial rollouts with a real engine process and a real Redis: a generation in chunks is the one-call
generation, a replica stopped mid-generation leaves its tokens in Redis with the task, and the replica
that takes the task over goes on from them; a saved sample the run's key did not sign is not used."""

import asyncio
import contextlib
import uuid

import pytest

from rlmesh.engine.client import EngineClient
from rlmesh.learner.ppo.batch import validate_trajectory
from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.queue import RunKeys, connect, prompt_queue, trajectory_queue
from rlmesh.queue.partials import PartialSample, PartialStore
from rlmesh.queue.signing import UNTRUSTED
from rlmesh.rollout.resilience import CircuitBreaker
from rlmesh.rollout.sampler import SamplerLoop, SamplerSettings
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import reward_pb2, trajectory_pb2
from tests.support.polling import eventually

LIMIT, CHUNK = 12, 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = build_tiny_model(
        tmp_path_factory.mktemp("m"), build_tokenizer(), hidden_size=64, num_layers=2, seed=5
    )
    with ProcessLauncher(tmp_path_factory.mktemp("partial"), stop_grace_s=20) as launcher:
        yield launcher.start_redis(), launcher.start_engine(model)


class GatedEngine(EngineClient):
    """The real engine client; generate calls after the first ``open_calls`` wait for ``gate``."""

    def __init__(self, url, open_calls):
        super().__init__(url)
        self.open_calls = open_calls
        self.gate = asyncio.Event()
        self.calls = 0

    async def generate(self, input_ids, sampling_params, **kw):
        self.calls += 1
        if self.calls > self.open_calls:
            await self.gate.wait()
        return await super().generate(input_ids, sampling_params, **kw)


async def score(samples):
    return [reward_pb2.RewardResult(uid=s.uid, score=float(len(s.response_ids))) for s in samples]


def sampler(redis, keys, replica, engine, temperature=1.0, chunk=CHUNK):
    return SamplerLoop(
        prompts=prompt_queue(redis, keys, replica, claim_idle_ms=60_000),
        trajectories=trajectory_queue(redis, keys, replica),
        engine=engine,
        score=score,
        ref_logprobs=None,
        settings=SamplerSettings(
            replica_id=replica,
            claim_block_ms=100,
            backoff_s=0.05,
            max_backoff_s=0.2,
            sampling_defaults={"max_new_tokens": LIMIT, "temperature": temperature, "ignore_eos": True},
            partial_chunk_tokens=chunk,
        ),
        reward_breaker=CircuitBreaker("reward"),
        reference_breaker=CircuitBreaker("reference"),
        partials=PartialStore(redis, keys),
    )


def task(uid, n=2):
    return trajectory_pb2.PromptTask(uid=uid, group_uid=uid, n=n, prompt_ids=[5, 6, 7], step=1)


async def trajectories(redis, keys, want):
    learner = trajectory_queue(redis, keys, "learner")
    await learner.ensure_group()
    got = []
    while len(got) < want:
        got += [d.message for d in await learner.claim(want - len(got), block_ms=200)]
    return sorted(got, key=lambda t: t.sample_index)


@contextlib.asynccontextmanager
async def running(loop):
    runner = asyncio.create_task(loop.run())
    try:
        yield loop
    finally:
        await loop.stop(timeout_s=5)
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner


async def test_greedy_generation_in_chunks_is_the_generation_in_one_call(stack):
    redis_server, engine = stack
    redis, keys = connect(redis_server.url), RunKeys(f"c-{uuid.uuid4().hex[:6]}")
    client = EngineClient(engine.url)
    whole = await client.generate(
        [5, 6, 7], {"max_new_tokens": LIMIT, "temperature": 0.0, "ignore_eos": True}, return_logprob=True
    )
    await prompt_queue(redis, keys, "learner").put([task("t0", n=1)])
    counting = GatedEngine(engine.url, open_calls=10_000)
    async with running(sampler(redis, keys, "replica-a", counting, temperature=0.0)):
        (traj,) = await asyncio.wait_for(trajectories(redis, keys, 1), 60)
    assert counting.calls == LIMIT // CHUNK  # one call per chunk
    assert list(traj.response_ids) == whole["output_ids"]
    one_call = [lp for lp, _, _ in whole["meta_info"]["output_token_logprobs"]]
    assert list(traj.rollout_log_probs) == pytest.approx(one_call, abs=1e-4)
    assert (traj.resumed_tokens, list(traj.token_policy_versions)) == (0, [0] * LIMIT)
    assert not await redis.exists(PartialStore(redis, keys).key("t0"))  # forgotten once published
    await client.aclose()


async def test_a_replica_stopped_mid_generation_leaves_its_tokens_and_another_goes_on_from_them(stack):
    redis_server, engine = stack
    redis, keys = connect(redis_server.url), RunKeys.signed(f"r-{uuid.uuid4().hex[:6]}", "the-runs-token")
    store = PartialStore(redis, keys)
    await prompt_queue(redis, keys, "learner").put([task("t1")])
    stuck = GatedEngine(engine.url, open_calls=2)  # two chunks, then the third never comes back
    first = sampler(redis, keys, "replica-a", stuck)
    async with running(first):

        async def tokens_saved():
            return sorted(len(s.output_ids) for s in (await store.load("t1", LIMIT)).values())

        await eventually(tokens_saved, [2 * CHUNK, 2 * CHUNK], "two chunks of both samples saved")
        saved = await store.load("t1", LIMIT)
        assert await first.stop(timeout_s=0) == 1  # given up on, and given back to the queue
    second = sampler(redis, keys, "replica-b", EngineClient(engine.url))
    async with running(second):
        got = await asyncio.wait_for(trajectories(redis, keys, 2), 60)
    for traj in got:
        kept = saved[traj.sample_index]
        assert list(traj.response_ids[: 2 * CHUNK]) == list(kept.output_ids)
        assert list(traj.rollout_log_probs[: 2 * CHUNK]) == list(kept.log_probs)
        assert (
            len(traj.response_ids) == len(traj.rollout_log_probs) == len(traj.token_policy_versions) == LIMIT
        )
        assert traj.resumed_tokens == 2 * CHUNK and traj.replica_id == "replica-b"
        assert validate_trajectory(traj) is None
    assert second.metrics.resumed_tokens._value.get() == 2 * 2 * CHUNK
    assert second.metrics.resumed_samples._value.get() == 2
    assert not await redis.exists(store.key("t1"))


async def test_a_saved_sample_the_runs_key_did_not_sign_is_generated_again(stack):
    redis_server, engine = stack
    run = f"f-{uuid.uuid4().hex[:6]}"
    redis, keys = connect(redis_server.url), RunKeys.signed(run, "the-runs-token")
    forged = PartialSample(output_ids=[9] * 6, log_probs=[-0.01] * 6, token_policy_versions=[0] * 6)
    await PartialStore(redis, RunKeys.signed(run, "another-token")).save("t2", {0: forged, 1: forged})
    prompts = prompt_queue(redis, keys, "replica-gone", claim_idle_ms=60_000)
    await prompts.put([task("t2")])
    await prompts.ensure_group()
    (held,) = await prompts.claim(1, block_ms=100)
    await prompts.release([held.entry_id])  # given back by a replica that left, as after a kill
    before = UNTRUSTED.total("partial_sample")
    async with running(sampler(redis, keys, "replica-b", EngineClient(engine.url))) as loop:
        got = await asyncio.wait_for(trajectories(redis, keys, 2), 60)
    assert UNTRUSTED.total("partial_sample") - before == 2
    assert [t.resumed_tokens for t in got] == [0, 0] and loop.metrics.resumed_tokens._value.get() == 0
    assert all(len(t.response_ids) == LIMIT for t in got)


async def test_samples_of_one_task_resumed_at_different_lengths_go_on_in_calls_of_their_own(stack):
    """Two samples saved at 10 and 2 tokens (limit 12, chunks of 4) need calls of 2 and 4 tokens: two
    requests for one task at once, each with its own request id (one id twice is refused)."""
    redis_server, engine = stack
    redis, keys = connect(redis_server.url), RunKeys.signed(f"u-{uuid.uuid4().hex[:6]}", "the-runs-token")
    saved = {
        i: PartialSample(output_ids=[7] * k, log_probs=[-0.5] * k, token_policy_versions=[0] * k)
        for i, k in ((0, 10), (1, 2))
    }
    await PartialStore(redis, keys).save("t3", saved)
    prompts = prompt_queue(redis, keys, "learner")
    await prompts.put([task("t3")])
    async with running(sampler(redis, keys, "replica-b", EngineClient(engine.url), chunk=4)) as loop:
        got = await asyncio.wait_for(trajectories(redis, keys, 2), 60)
    assert [len(t.response_ids) for t in got] == [LIMIT, LIMIT]
    assert [list(t.response_ids[:k]) for t, k in zip(got, (10, 2), strict=True)] == [[7] * 10, [7] * 2]
    assert [t.resumed_tokens for t in got] == [10, 2] and loop.metrics.resumed_tokens._value.get() == 12
    assert await prompts.dead_letters() == []
