"""The sampler loop with a real engine process, real Redis and real gRPC reward/reference servers
(small servicers defined here: the sampler must work with any service that speaks the protos)."""

import asyncio
import contextlib
import uuid
from types import SimpleNamespace

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.engine.client import EngineClient
from rlmesh.learner.ppo.batch import validate_trajectory
from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.queue import RunKeys, connect, prompt_queue, trajectory_queue
from rlmesh.rollout.resilience import CircuitBreaker
from rlmesh.rollout.sampler import SamplerLoop, SamplerSettings
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.net import free_port
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import (
    common_pb2,
    reference_pb2,
    reference_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    trajectory_pb2,
)
from tests.support.polling import eventually
from tests.support.streams import blocked_reads


class LengthReward(reward_pb2_grpc.RewardServicer):
    """score = response length / 10; a response containing token 13 fails with a per-sample error."""

    def __init__(self):
        self.calls = []  # samples per call

    async def Score(self, request, context):
        self.calls.append(len(request.samples))
        results = []
        for s in request.samples:
            if 13 in s.response_ids:
                results.append(
                    reward_pb2.RewardResult(
                        uid=s.uid,
                        error=common_pb2.SampleError(
                            code=common_pb2.ERROR_CODE_FUNCTION_FAILED, message="13 is unlucky"
                        ),
                    )
                )
            else:
                results.append(
                    reward_pb2.RewardResult(
                        uid=s.uid, score=len(s.response_ids) / 10, extra={"len": len(s.response_ids)}
                    )
                )
        return reward_pb2.ScoreResponse(results=results)


class TokenSumReward(reward_pb2_grpc.RewardServicer):
    """score = sum of the response's token ids / 1000 (responses differ, so do their scores); keeps
    every sample it was sent; a sample whose uid is in ``fail`` fails with a per-sample error."""

    def __init__(self, fail=()):
        self.fail = set(fail)
        self.calls = []  # samples per call
        self.samples = {}  # uid -> RewardSample

    @staticmethod
    def score_of(response_ids):
        return sum(response_ids) / 1000

    async def Score(self, request, context):
        self.calls.append(len(request.samples))
        results = []
        for s in request.samples:
            self.samples[s.uid] = s
            if s.uid in self.fail:
                error = common_pb2.SampleError(code=common_pb2.ERROR_CODE_FUNCTION_FAILED, message="no")
                results.append(reward_pb2.RewardResult(uid=s.uid, error=error))
            else:
                results.append(reward_pb2.RewardResult(uid=s.uid, score=self.score_of(s.response_ids)))
        return reward_pb2.ScoreResponse(results=results)


class ModelReference(reference_pb2_grpc.ReferenceServicer):
    def __init__(self, model):
        self.model = model
        self.calls = []  # samples per call

    async def LogProbs(self, request, context):
        self.calls.append(len(request.samples))
        results = []
        with torch.no_grad():
            for s in request.samples:
                ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
                logp = torch.log_softmax(self.model(ids).logits[0].float(), -1)
                p = len(s.prompt_ids)
                results.append(
                    reference_pb2.LogProbsResult(
                        uid=s.uid, log_probs=[logp[p - 1 + i, t].item() for i, t in enumerate(s.response_ids)]
                    )
                )
        return reference_pb2.LogProbsResponse(results=results)


class CountingEngine(EngineClient):
    """The real engine client, keeping how many prompts each generate call carried."""

    def __init__(self, url):
        super().__init__(url)
        self.calls = []

    async def generate(self, input_ids, sampling_params, **kw):
        self.calls.append(len(input_ids) if isinstance(input_ids[0], list) else 1)
        return await super().generate(input_ids, sampling_params, **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("m"), build_tokenizer(), hidden_size=64, num_layers=2, seed=3
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    with ProcessLauncher(tmp_path_factory.mktemp("sampler"), stop_grace_s=20) as launcher:
        redis = launcher.start_redis()
        engine = launcher.start_engine(model_dir)
        yield redis, engine


async def start_server(servicer, add_fn, name, port=0):
    service = GrpcService(name, port=port, metrics_port=None, shutdown_grace_s=1)
    service.add_servicer(add_fn, servicer, f"rlmesh.v1.{name.capitalize()}")
    await service.start()
    return service


async def make_sampler(redis_url, engine_url, keys, reward_addr, ref_addr, traj_maxlen=100_000, **settings):
    redis = connect(redis_url)
    reward_ch = grpc.aio.insecure_channel(reward_addr)
    ref_ch = grpc.aio.insecure_channel(ref_addr)

    async def score(samples):
        return list(
            (
                await reward_pb2_grpc.RewardStub(reward_ch).Score(
                    reward_pb2.ScoreRequest(samples=samples), timeout=5
                )
            ).results
        )

    async def ref(samples):
        return list(
            (
                await reference_pb2_grpc.ReferenceStub(ref_ch).LogProbs(
                    reference_pb2.LogProbsRequest(samples=samples), timeout=30
                )
            ).results
        )

    sampler = SamplerLoop(
        prompts=prompt_queue(redis, keys, "replica-1"),
        trajectories=trajectory_queue(redis, keys, "replica-1", maxlen=traj_maxlen),
        engine=CountingEngine(engine_url),
        score=score,
        ref_logprobs=ref,
        settings=SamplerSettings(
            **{
                "replica_id": "replica-1",
                "claim_block_ms": 100,
                "backoff_s": 0.05,
                "max_backoff_s": 0.2,
                "sampling_defaults": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True},
                **settings,
            }
        ),
        reward_breaker=CircuitBreaker("reward", failures=3, reset_s=0.2),
        reference_breaker=CircuitBreaker("reference", failures=3, reset_s=0.2),
    )
    return sampler, redis, [reward_ch, ref_ch]


def task(uid, n=2, prompt=(5, 6, 7), **kw):
    return trajectory_pb2.PromptTask(
        uid=uid,
        group_uid=f"g-{uid}",
        n=n,
        prompt_ids=list(prompt),
        ground_truth="42",
        data_source="test",
        step=1,
        **kw,
    )


async def collect(redis, keys, want, timeout_s=60):
    learner = trajectory_queue(redis, keys, "learner")
    await learner.ensure_group()
    got = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(got) < want:
        assert loop.time() < deadline, f"only {len(got)} of {want} trajectories arrived"
        got += [d.message for d in await learner.claim(want - len(got), block_ms=200)]
    return got


@pytest.fixture(scope="module")
def reference_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@contextlib.asynccontextmanager
async def running_sampler(
    stack, reference_model, *, reward_up=True, traj_maxlen=100_000, reward=None, **settings
):
    """A sampler on the real engine with fresh queues, a reference server and (unless
    ``reward_up=False``) a reward server on ``ctx.reward_port`` (``reward``, default a
    ``LengthReward``); everything stops on exit, servers the test appended to ``ctx.servers``
    included. ``settings`` override the ``SamplerSettings``."""
    redis_server, engine = stack
    keys = RunKeys(f"s-{uuid.uuid4().hex[:6]}")
    reward_port = free_port()
    reference, reward = ModelReference(reference_model), reward or LengthReward()
    servers = [await start_server(reference, reference_pb2_grpc.add_ReferenceServicer_to_server, "reference")]
    if reward_up:
        servers.append(
            await start_server(
                reward, reward_pb2_grpc.add_RewardServicer_to_server, "reward", port=reward_port
            )
        )
    sampler, redis, chans = await make_sampler(
        redis_server.url,
        engine.url,
        keys,
        f"127.0.0.1:{reward_port}",
        servers[0].address,
        traj_maxlen=traj_maxlen,
        **settings,
    )
    runner = asyncio.create_task(sampler.run())
    prompts = prompt_queue(redis, keys, "learner")
    await prompts.ensure_group()
    ctx = SimpleNamespace(
        sampler=sampler,
        redis=redis,
        keys=keys,
        prompts=prompts,
        reward_port=reward_port,
        servers=servers,
        reward=reward,
        reference=reference,
    )
    try:
        yield ctx
    finally:
        await sampler.stop(5)
        runner.cancel()
        for server in ctx.servers:
            await server.stop()
        for ch in chans:
            await ch.close()
        await redis.aclose()


async def test_tasks_become_scored_trajectories_with_reference_logprobs(stack, reference_model):
    async with running_sampler(stack, reference_model) as ctx:
        await ctx.prompts.put([task("a", n=3), task("b", n=2, prompt=(9, 10), sample_offset=2)])
        trajs = await collect(ctx.redis, ctx.keys, 5)
        by_uid = {t.uid: t for t in trajs}
        assert sorted(by_uid) == ["g-a/0", "g-a/1", "g-a/2", "g-b/2", "g-b/3"]
        for t in trajs:
            assert len(t.response_ids) == 6 and len(t.rollout_log_probs) == 6 and len(t.ref_log_probs) == 6
            assert t.replica_id == "replica-1" and t.ground_truth == "42" and t.step == 1
            assert t.finish_reason == "length" and t.timings.total_s >= t.timings.generate_s > 0
            # The engine said which weights sampled each token: its first ("default", version 0).
            assert list(t.token_policy_versions) == [0] * 6 and t.policy_version == 0
            if t.HasField("error"):
                assert 13 in t.response_ids and t.error.message == "13 is unlucky"
            else:
                assert t.score == pytest.approx(0.6) and t.reward_extra["len"] == 6
            # the engine's rollout log-probs and the reference's agree: same weights
            assert max(abs(a - b) for a, b in zip(t.rollout_log_probs, t.ref_log_probs, strict=True)) < 1e-4
        # Acked right after publishing: the prompt stream empties.
        deadline = asyncio.get_running_loop().time() + 30
        while await ctx.prompts.length():
            assert asyncio.get_running_loop().time() < deadline, "prompt tasks were never acked"
            await asyncio.sleep(0.02)


async def test_one_claim_is_one_wave_one_score_call_and_one_reference_call(stack, reference_model):
    async with running_sampler(stack, reference_model, claim_block_ms=20_000) as ctx:
        await eventually(lambda: blocked_reads(ctx.redis), 1, "the sampler to block on the empty stream")
        await ctx.sampler.pause()
        greedy = common_pb2.SamplingParams(temperature=0.0)
        await ctx.prompts.put(
            [task("w1", n=2), task("w2", n=2, prompt=(8, 9)), task("w3", n=3, sampling_params=greedy)]
        )
        ctx.sampler.resume()
        trajs = await collect(ctx.redis, ctx.keys, 7)
        assert sorted(t.uid for t in trajs) == [
            "g-w1/0",
            "g-w1/1",
            "g-w2/0",
            "g-w2/1",
            "g-w3/0",
            "g-w3/1",
            "g-w3/2",
        ]
        # Each task's samples came from its own prompt, and the greedy task's from greedy decoding.
        assert {tuple(t.prompt_ids) for t in trajs if t.group_uid == "g-w2"} == {(8, 9)}
        assert len({tuple(t.response_ids) for t in trajs if t.group_uid == "g-w3"}) == 1
        # Two sampling settings: two engine calls (2 prompts, then 1); one Score and one LogProbs
        # call for all seven samples; the tasks acked together.
        assert sorted(ctx.sampler.engine.calls) == [1, 2]
        assert ctx.reward.calls == [7] and ctx.reference.calls == [7]
        await eventually(ctx.prompts.length, 0, "the tasks to be acked")


async def test_a_reward_outage_stalls_trajectories_and_loses_none(stack, reference_model):
    async with running_sampler(stack, reference_model, reward_up=False) as ctx:
        await ctx.prompts.put([task("x", n=2), task("y", n=2)])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while ctx.sampler.metrics.retries.labels("reward")._value.get() < 4:
            assert loop.time() < deadline, "the sampler never retried the missing reward service"
            await asyncio.sleep(0.05)
        assert ctx.sampler.reward_breaker.consecutive_failures >= 3  # the breaker opened
        # stalled, not dropped
        assert await ctx.redis.xlen(ctx.keys.trajectories) == 0 and await ctx.prompts.length() == 2
        ctx.servers.append(
            await start_server(
                LengthReward(), reward_pb2_grpc.add_RewardServicer_to_server, "reward", port=ctx.reward_port
            )
        )
        trajs = await collect(ctx.redis, ctx.keys, 4)
        assert sorted(t.uid for t in trajs) == ["g-x/0", "g-x/1", "g-y/0", "g-y/1"]
        while await ctx.prompts.length():
            assert loop.time() < deadline
            await asyncio.sleep(0.05)


async def test_a_task_the_engine_refuses_goes_to_dead_letters(stack, reference_model):
    async with running_sampler(stack, reference_model) as ctx:
        # "fine" shares the engine call of "bad" (same sampling params): the engine refuses the call,
        # and only "bad" is lost.
        await ctx.prompts.put(
            [task("bad", prompt=(5, 100000)), task("good", n=1), task("fine", prompt=(3, 4))]
        )
        trajs = await collect(ctx.redis, ctx.keys, 3)
        assert sorted(t.uid for t in trajs) == ["g-fine/0", "g-fine/1", "g-good/0"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while await ctx.redis.xlen(ctx.keys.dead_letters) == 0:
            assert loop.time() < deadline
            await asyncio.sleep(0.05)
        ((_, fields),) = await ctx.redis.xrange(ctx.keys.dead_letters)
        assert b"token ids must be integers in [0, 100)" in fields[b"reason"]
        assert trajectory_pb2.PromptTask.FromString(fields[b"p"]).uid == "bad"
        await eventually(ctx.prompts.length, 0, "the good task to be acked")


async def test_pause_and_drain_end_a_blocked_claim_and_nothing_is_claimed_until_resume(
    stack, reference_model
):
    # A claim blocks far longer than the test: one that ends did so because pause() woke it.
    async with running_sampler(stack, reference_model, claim_block_ms=20_000) as ctx:
        await eventually(lambda: blocked_reads(ctx.redis), 1, "the sampler to block on the empty stream")
        await ctx.sampler.pause()
        # The loop has no claim in progress and Redis holds no read for it: nothing can be claimed,
        # and a read still blocked would be handed the tasks before put() is even answered.
        assert ctx.sampler.paused and not ctx.sampler.claim_in_progress
        assert await blocked_reads(ctx.redis) == 0
        await ctx.prompts.put([task("p1", n=1), task("p2", n=1)])
        assert await ctx.prompts.pending() == 0 and await ctx.prompts.unread() == 2
        assert ctx.sampler.in_flight == 0 and not ctx.sampler.claim_in_progress

        ctx.sampler.resume()
        trajs = await collect(ctx.redis, ctx.keys, 2)
        assert sorted(t.uid for t in trajs) == ["g-p1/0", "g-p2/0"]
        await eventually(ctx.prompts.length, 0, "the tasks to be acked")

        # Drain pauses the same way before it waits for in-flight work.
        await eventually(lambda: blocked_reads(ctx.redis), 1, "the sampler to block again")
        assert await ctx.sampler.drain(5) == 0
        assert await blocked_reads(ctx.redis) == 0 and not ctx.sampler.claim_in_progress
        await ctx.prompts.put([task("p3", n=1)])
        assert await ctx.prompts.pending() == 0 and await ctx.prompts.unread() == 1


async def test_an_aborted_generation_is_generated_again_and_never_published(stack, reference_model):
    _, engine = stack
    client = EngineClient(engine.url)
    async with running_sampler(stack, reference_model) as ctx:
        await client.pause_generation()
        try:
            await ctx.prompts.put([task("cut", n=2)])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while (await client.server_info()).get("waiting", 0) == 0:
                assert loop.time() < deadline, "the task never reached the engine"
                await asyncio.sleep(0.02)
            await client.abort_request(abort_all=True)  # the replica gets finish_reason "abort"
            while ctx.sampler.metrics.retries.labels("engine")._value.get() < 1:
                assert loop.time() < deadline, "the aborted generation was not retried"
                await asyncio.sleep(0.02)
        finally:
            await client.continue_generation()
            await client.aclose()
        trajs = await collect(ctx.redis, ctx.keys, 2)
        assert sorted(t.uid for t in trajs) == ["g-cut/0", "g-cut/1"]
        assert {t.finish_reason for t in trajs} == {"length"} and all(len(t.response_ids) == 6 for t in trajs)
        # The aborted pair would have been published first: only the regenerated pair is there.
        assert await ctx.redis.xlen(ctx.keys.trajectories) == 2
        assert await ctx.redis.xlen(ctx.keys.dead_letters) == 0


async def test_a_full_trajectory_stream_holds_the_task_until_the_learner_consumes(stack, reference_model):
    async with running_sampler(stack, reference_model, traj_maxlen=4) as ctx:
        await ctx.prompts.put([task("first", n=3)])
        learner = trajectory_queue(ctx.redis, ctx.keys, "learner")
        await learner.ensure_group()
        first = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while len(first) < 3:
            assert loop.time() < deadline
            first += await learner.claim(3, block_ms=200)
        await ctx.prompts.put([task("second", n=2)])  # 3 + 2 > 4: must wait, not be dropped
        while ctx.sampler.metrics.retries.labels("trajectory_stream")._value.get() < 2:
            assert loop.time() < deadline, "the sampler never met the full stream"
            await asyncio.sleep(0.02)
        assert await ctx.redis.xlen(ctx.keys.dead_letters) == 0 and await ctx.prompts.pending() == 1
        await learner.ack([d.entry_id for d in first])  # the learner consumed: room again
        second = await collect(ctx.redis, ctx.keys, 2)
        assert sorted(t.uid for t in second) == ["g-second/0", "g-second/1"]
        while await ctx.prompts.length():
            assert loop.time() < deadline, "the held task was never acked"
            await asyncio.sleep(0.02)


def greedy_decode(model, prompt, length):
    """Argmax continuation of ``prompt`` by the reference model (the engine's weights), token by token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(length):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def test_a_remax_task_is_baselined_by_its_greedy_response_scored_by_the_reward_service(
    stack, reference_model
):
    reward = TokenSumReward()
    async with running_sampler(stack, reference_model, reward=reward, claim_block_ms=20_000) as ctx:
        await eventually(lambda: blocked_reads(ctx.redis), 1, "the sampler to block on the empty stream")
        await ctx.sampler.pause()
        # One wave: a remax task (temperature 1 samples + one greedy baseline) and a plain one.
        await ctx.prompts.put([task("rx", n=3, greedy_baseline=True), task("plain", n=3, prompt=(8, 9))])
        ctx.sampler.resume()
        trajs = await collect(ctx.redis, ctx.keys, 6)
        await eventually(ctx.prompts.length, 0, "the tasks to be acked")
        # The baseline is never published: only the n samples of each task are trajectories.
        assert sorted(t.uid for t in trajs) == [f"g-{g}/{i}" for g in ("plain", "rx") for i in range(3)]
        assert await ctx.redis.xlen(ctx.keys.trajectories) == 6

        # The reward service scored the greedy response with the samples, in one call; the
        # reference was asked for the samples only (no KL on the baseline).
        assert reward.calls == [7] and ctx.reference.calls == [6]
        baseline = reward.samples["g-rx/baseline"]
        assert list(baseline.prompt_ids) == [5, 6, 7] and baseline.ground_truth == "42"
        assert list(baseline.response_ids) == greedy_decode(reference_model, (5, 6, 7), 6)
        # The two tasks' samples (same settings) in one engine call, the greedy response in another.
        assert sorted(ctx.sampler.engine.calls) == [1, 2]

        expected = TokenSumReward.score_of(greedy_decode(reference_model, (5, 6, 7), 6))
        for t in trajs:
            assert not t.HasField("error")
            assert t.score == TokenSumReward.score_of(t.response_ids)
            if t.group_uid == "g-rx":
                assert t.HasField("baseline_score") and t.baseline_score == pytest.approx(expected)
            else:
                assert not t.HasField("baseline_score")


async def test_a_baseline_the_reward_service_fails_fails_its_samples(stack, reference_model):
    reward = TokenSumReward(fail={"g-bf/baseline"})
    async with running_sampler(stack, reference_model, reward=reward) as ctx:
        # "bad" is refused by the engine in both its calls (samples and greedy baseline): one
        # dead letter, and nothing of it published.
        await ctx.prompts.put(
            [task("bf", n=2, greedy_baseline=True), task("bad", prompt=(5, 100000), greedy_baseline=True)]
        )
        trajs = await collect(ctx.redis, ctx.keys, 2)
        assert sorted(t.uid for t in trajs) == ["g-bf/0", "g-bf/1"]
        for t in trajs:
            # Published with the reason (the task is done), never trained on: the learner refuses it.
            assert not t.HasField("baseline_score")
            assert t.error.code == common_pb2.ERROR_CODE_FUNCTION_FAILED
            assert t.error.message == "greedy baseline: no"
            assert validate_trajectory(t, needs_baseline=True).startswith("error:")
        await eventually(ctx.prompts.length, 0, "the tasks to be acked or dead-lettered")
        ((_, fields),) = await ctx.redis.xrange(ctx.keys.dead_letters)
        assert trajectory_pb2.PromptTask.FromString(fields[b"p"]).uid == "bad"
        assert await ctx.redis.xlen(ctx.keys.trajectories) == 2
