"""Rollout replicas as real processes (each with its embedded engine) with the real reward and
reference services and a real Redis."""

import asyncio
import contextlib
import os
import signal
import uuid

import grpc
import pytest

from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.queue import ReplicaRegistry, RunKeys, connect, prompt_queue, trajectory_queue
from rlmesh.queue.policy import publish_policy
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trajectory_pb2
from tests.support.polling import eventually, wait_until
from tests.support.processes import pid_alive
from tests.support.streams import blocked_reads

RUN = f"rollout-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tok = build_tokenizer()
    a = build_tiny_model(tmp_path_factory.mktemp("a"), tok, hidden_size=64, num_layers=2, seed=5)
    b = build_tiny_model(tmp_path_factory.mktemp("b"), tok, hidden_size=64, num_layers=2, seed=6)
    return a, b


@pytest.fixture(scope="module")
def stack(tmp_path_factory, models):
    model, _ = models
    with ProcessLauncher(tmp_path_factory.mktemp("rollout-stack"), stop_grace_s=20) as launcher:
        redis = launcher.start_redis()
        common = [
            f"rlmesh.run_id={RUN}",
            f"rlmesh.redis_url={redis.url}",
            f"actor_rollout_ref.model.path={model}",
            "rlmesh.log_format=text",
        ]
        reward = launcher.start_service(
            "reward", overrides=[*common, "rlmesh.reward.port=0", "rlmesh.reward.metrics_port=0"]
        )
        reference = launcher.start_service(
            "reference", overrides=[*common, "rlmesh.reference.port=0", "rlmesh.reference.metrics_port=0"]
        )
        overrides = [
            *common,
            "rlmesh.rollout.port=0",
            "rlmesh.rollout.metrics_port=0",
            f"rlmesh.reward.addresses=['{reward.grpc_address}']",
            f"rlmesh.reference.addresses=['{reference.grpc_address}']",
            "algorithm.use_kl_in_reward=true",
            "rlmesh.queue.claim_idle_ms=1500",
            "rlmesh.queue.heartbeat_ttl_s=3",
            "actor_rollout_ref.rollout.response_length=16",
            "actor_rollout_ref.rollout.ignore_eos=true",
        ]
        yield launcher, redis, overrides


def start_replica(launcher, overrides, name):
    return launcher.start_service(
        "rollout", name=name, overrides=[*overrides, f"rlmesh.sampler.replica_id={name}"], timeout_s=180
    )


def task(uid, n=2, max_new_tokens=None):
    sp = common_pb2.SamplingParams()
    if max_new_tokens:
        sp.max_new_tokens = max_new_tokens
    return trajectory_pb2.PromptTask(
        uid=uid,
        group_uid=uid,
        n=n,
        prompt_ids=[30, 31, 32],
        prompt_text="What is 1+1?",
        ground_truth="2",
        data_source="arithmetic",
        step=1,
        sampling_params=sp,
    )


async def collect(redis, want, timeout_s=120):
    learner = trajectory_queue(redis, RunKeys(RUN), "learner")
    await learner.ensure_group()
    got = []
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(got) < want:
        assert asyncio.get_running_loop().time() < deadline, f"{len(got)} of {want} trajectories arrived"
        batch = await learner.claim(want - len(got), block_ms=200)
        await learner.ack([d.entry_id for d in batch])
        got += [d.message for d in batch]
    return got


async def test_replica_registers_serves_tasks_and_answers_rpcs(stack):
    launcher, redis_server, overrides = stack
    replica = start_replica(launcher, overrides, "replica-a")
    redis = connect(redis_server.url)
    try:
        live = await ReplicaRegistry(redis, RunKeys(RUN)).live()
        assert [r.replica_id for r in live] == ["replica-a"] and live[0].engine == "embedded"
        prompts = prompt_queue(redis, RunKeys(RUN), "learner")
        await prompts.ensure_group()
        await prompts.put([task("t1"), task("t2", n=3)])
        trajs = await collect(redis, 5)
        assert sorted(t.uid for t in trajs) == ["t1/0", "t1/1", "t2/0", "t2/1", "t2/2"]
        assert all(len(t.response_ids) == 16 and len(t.ref_log_probs) == 16 for t in trajs)
        assert all(t.replica_id == "replica-a" and not t.HasField("error") for t in trajs)
        async with grpc.aio.insecure_channel(replica.grpc_address) as ch:
            stub = rollout_pb2_grpc.RolloutStub(ch)

            async def tasks_done():
                return (await stub.GetInfo(common_pb2.Empty())).tasks_done

            await eventually(tasks_done, 2, "both tasks to be acked")  # the ack follows the publish
            info = await stub.GetInfo(common_pb2.Empty())
            assert info.replica_id == "replica-a" and info.state == "serving"
            out = await stub.Generate(
                rollout_pb2.GenerateRequest(
                    inputs=[rollout_pb2.GenerateInput(uid="x", prompt_ids=[1, 2, 3])],
                    sampling_params=common_pb2.SamplingParams(max_new_tokens=4, temperature=0),
                    return_logprob=True,
                )
            )
            assert (
                len(out.outputs) == 1
                and len(out.outputs[0].output_ids) == 4
                and len(out.outputs[0].output_log_probs) == 4
            )
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.Generate(
                    rollout_pb2.GenerateRequest(
                        inputs=[rollout_pb2.GenerateInput(uid="y", prompt_ids=[5000])]
                    )
                )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            drained = await stub.Drain(rollout_pb2.DrainRequest(timeout_s=30))
            assert drained.drained and drained.unfinished == 0
        assert await ReplicaRegistry(redis, RunKeys(RUN)).live() == []
        assert launcher.stop(replica.process) == 0
    finally:
        await redis.aclose()


async def test_pause_and_drain_answer_only_once_nothing_more_can_be_claimed(stack):
    launcher, redis_server, overrides = stack
    # Claims block far longer than the test: one that ends early was woken by Pause or Drain.
    replica = start_replica(launcher, [*overrides, "rlmesh.sampler.claim_block_ms=20000"], "pauser")
    redis = connect(redis_server.url)
    keys = RunKeys(RUN)
    try:
        prompts = prompt_queue(redis, keys, "learner")
        await prompts.ensure_group()
        async with grpc.aio.insecure_channel(replica.grpc_address) as ch:
            stub = rollout_pb2_grpc.RolloutStub(ch)
            await eventually(lambda: blocked_reads(redis), 1, "the replica to block on the empty stream")
            assert (await stub.Pause(common_pb2.Empty())).success
            # Redis holds no read for the replica any more, so tasks added now stay unclaimed: a
            # read still blocked would be handed them before put() is even answered.
            assert await blocked_reads(redis) == 0
            assert (await stub.GetInfo(common_pb2.Empty())).state == "paused"
            await prompts.put([task("held-1", n=1), task("held-2", n=1)])
            assert await prompts.pending() == 0 and await prompts.unread() == 2
            info = await stub.GetInfo(common_pb2.Empty())
            assert info.running_requests == 0 and info.tasks_done == 0

            assert (await stub.Resume(common_pb2.Empty())).success
            trajs = await collect(redis, 2)
            assert sorted(t.uid for t in trajs) == ["held-1/0", "held-2/0"]
            await eventually(lambda: prompts.length(), 0, "the tasks to be acked")

            await eventually(lambda: blocked_reads(redis), 1, "the replica to block again")
            drained = await stub.Drain(rollout_pb2.DrainRequest(timeout_s=30))
            assert drained.drained and await blocked_reads(redis) == 0
            await prompts.put([task("after-drain", n=1)])
            assert await prompts.pending() == 0 and await prompts.unread() == 1
        assert launcher.stop(replica.process) == 0
        # Take the last task off the stream so that no later test's replica meets it.
        cleanup = prompt_queue(redis, keys, "cleanup")
        got = await cleanup.claim(5)
        assert [d.message.uid for d in got] == ["after-drain"]
        await cleanup.ack([d.entry_id for d in got])
    finally:
        await redis.aclose()


async def test_a_replica_killed_mid_task_leaves_it_to_another(stack):
    launcher, redis_server, overrides = stack
    doomed = start_replica(launcher, overrides, "doomed")
    redis = connect(redis_server.url)
    keys = RunKeys(RUN)
    try:
        prompts = prompt_queue(redis, keys, "learner")
        await prompts.ensure_group()
        await prompts.put([task("slow-1", n=2, max_new_tokens=400), task("slow-2", n=2, max_new_tokens=400)])

        async def held_by_doomed():
            rows = await redis.xpending_range(keys.prompts, "rollout", "-", "+", 10)
            return len([r for r in rows if r["consumer"] == b"doomed"]) == 2

        deadline = asyncio.get_running_loop().time() + 60
        while not await held_by_doomed():
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        engine_pid = None
        for proc in launcher.processes:
            if proc.name == "doomed-engine":
                engine_pid = proc.pid
        os.kill(doomed.process.pid, signal.SIGKILL)
        doomed.process.popen.wait()
        assert await redis.xlen(keys.trajectories) == 0
        rescuer = start_replica(launcher, overrides, "rescuer")
        trajs = await collect(redis, 4)
        assert sorted(t.uid for t in trajs) == ["slow-1/0", "slow-1/1", "slow-2/0", "slow-2/1"]
        assert {t.replica_id for t in trajs} == {"rescuer"}
        await eventually(lambda: prompts.length(), 0, "the rescued tasks to be acked")
        launcher.stop(rescuer.process)
        if engine_pid is not None:
            wait_until(lambda: not pid_alive(engine_pid), 30, "the killed replica's engine to exit")
    finally:
        await redis.aclose()


async def test_a_replica_joining_mid_run_loads_the_current_weights_first(stack, models):
    launcher, redis_server, overrides = stack
    _, newer = models
    redis = connect(redis_server.url)
    try:
        await publish_policy(redis, RunKeys(RUN), version=5, disk_path=str(newer))
        # A replica loads a snapshot only from inside the run's weights (or checkpoint) directory.
        joiner = start_replica(
            launcher, [*overrides, f"rlmesh.weight_sync.disk_dir={newer.parent}"], "joiner"
        )
        async with grpc.aio.insecure_channel(joiner.grpc_address) as ch:
            info = await rollout_pb2_grpc.RolloutStub(ch).GetInfo(common_pb2.Empty())
        assert info.policy_version == 5
        prompts = prompt_queue(redis, RunKeys(RUN), "learner")
        await prompts.put([task("late", n=1)])
        (traj,) = await collect(redis, 1)
        assert traj.policy_version == 5 and traj.replica_id == "joiner"
        launcher.stop(joiner.process)
    finally:
        await publish_policy(redis, RunKeys(RUN), version=0)
        await redis.aclose()


async def test_a_sampler_loop_that_fails_for_good_takes_the_replica_out_of_the_run(stack):
    # Its consumer group gone (a Redis restarted without persistence): every claim is refused with
    # NOGROUP, which no retry fixes. The replica must not stay SERVING while claiming nothing.
    launcher, redis_server, overrides = stack
    run = f"nogroup-{uuid.uuid4().hex[:6]}"
    replica = start_replica(launcher, [*overrides, f"rlmesh.run_id={run}"], "grouples")
    redis = connect(redis_server.url)
    keys = RunKeys(run)
    try:
        registry = ReplicaRegistry(redis, keys, ttl_s=3)
        assert [r.replica_id for r in await registry.live()] == ["grouples"]

        async def claiming() -> bool:  # its first claim made it a consumer of the run's group
            with contextlib.suppress(Exception):
                return any(
                    c["name"] == b"grouples" for c in await redis.xinfo_consumers(keys.prompts, "rollout")
                )
            return False

        await eventually(claiming, True, "the replica to claim")
        await redis.xgroup_destroy(keys.prompts, "rollout")
        assert await asyncio.to_thread(replica.process.popen.wait, 60) == 3
        log = replica.process.log_path.read_text()
        assert "sampler loop failed: ResponseError: NOGROUP" in log and "leaving the run" in log
        assert await registry.live() == []
    finally:
        await redis.aclose()
