"""A run's pieces with rlmesh.auth_token set and Redis behind a password, as real processes: a rollout
replica (its embedded engine behind the token) generates a task's samples and the learner's weight
pusher, its engine clients made as the learner makes them (the token from the environment that
every service exports), pushes new weights that the engine then serves. Neither secret reaches a
command line (the engine's included) or a log. What the replica writes to Redis is signed with the
run's key, and a task that is not (written by someone without the token) is dead-lettered unread."""

import asyncio
import uuid
from pathlib import Path

import pytest

from rlmesh.engine.client import EngineClient, EngineError
from rlmesh.job.report import engine_server_info
from rlmesh.learner.weight_sync.push import WeightPusher
from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.queue import ReplicaRegistry, RunKeys, connect, prompt_queue, trajectory_queue
from rlmesh.queue.signing import SIGNED_PREFIX
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import common_pb2, trajectory_pb2

TOKEN = "pipeline-token-3d1"
REDIS_PASSWORD = "pipeline-redis-pw-88"
RUN = f"token-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tok = build_tokenizer()
    start = build_tiny_model(tmp_path_factory.mktemp("start"), tok, hidden_size=64, num_layers=2, seed=5)
    target = build_tiny_model(tmp_path_factory.mktemp("target"), tok, hidden_size=64, num_layers=2, seed=6)
    return start, target


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


async def generate_and_push(redis_url: str, target_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    redis = connect(redis_url)
    keys = RunKeys.signed(RUN, TOKEN)  # as the learner makes them
    try:
        [replica] = await ReplicaRegistry(redis, keys).live()
        assert (await redis.get(keys.replica(replica.replica_id))).startswith(SIGNED_PREFIX)

        def task(uid: str) -> trajectory_pb2.PromptTask:
            return trajectory_pb2.PromptTask(
                uid=uid,
                group_uid=uid,
                n=2,
                prompt_ids=[30, 31, 32],
                ground_truth="2",
                data_source="arithmetic",
                step=1,
                sampling_params=common_pb2.SamplingParams(),
            )

        prompts = prompt_queue(redis, keys, "learner")
        await prompts.ensure_group()
        await prompt_queue(redis, RunKeys(RUN), "intruder").put([task("forged")])
        await prompts.put([task("t1")])
        learner = trajectory_queue(redis, keys, "learner")
        await learner.ensure_group()
        got: list[trajectory_pb2.Trajectory] = []
        while len(got) < 2:
            batch = await learner.claim(2 - len(got), block_ms=1000)
            await learner.ack([d.entry_id for d in batch])
            got += [d.message for d in batch]
        assert sorted(t.uid for t in got) == ["t1/0", "t1/1"]
        assert all(len(t.response_ids) == 8 and not t.HasField("error") for t in got)
        [dead] = await prompts.dead_letters()
        assert dead.message.uid == "forged" and dead.reason.startswith("unsigned: ")

        tokenless = EngineClient(replica.engine_url, timeout_s=60, token="")
        with pytest.raises(EngineError, match="answered 401"):
            await tokenless.update_weight_version("stolen")
        await tokenless.aclose()

        target = AutoModelForCausalLM.from_pretrained(target_dir).state_dict()
        client = EngineClient(replica.engine_url, timeout_s=120)  # as the learner's loop makes it
        pusher = WeightPusher([client], backend="gloo", timeout_s=60, verify_tensors=2)
        try:
            report = await pusher.push(target.items(), version=7)
            assert not report.failed and report.engines == [replica.engine_url.rstrip("/")]
            mismatches = await pusher.verify(dict(list(target.items())[:2]))
            assert all(m == [] for m in mismatches.values())
            assert (await client.model_info())["weight_version"] == "7"
        finally:
            await pusher.close()
            await client.aclose()
    finally:
        await redis.aclose()


def test_a_replica_generates_and_takes_pushed_weights_with_a_token_and_a_redis_password(
    tmp_path, models, monkeypatch
):
    start, target = models
    monkeypatch.setenv("RLMESH_AUTH_TOKEN", TOKEN)  # what service_main exports in the learner
    with ProcessLauncher(tmp_path, stop_grace_s=20) as launcher:
        redis = launcher.start_redis(password=REDIS_PASSWORD)
        common = [
            f"rlmesh.run_id={RUN}",
            f"rlmesh.redis_url={redis.url}",
            f"rlmesh.auth_token={TOKEN}",
            f"actor_rollout_ref.model.path={start}",
            "rlmesh.log_format=text",
        ]
        reward = launcher.start_service(
            "reward", overrides=[*common, "rlmesh.reward.port=0", "rlmesh.reward.metrics_port=0"]
        )
        replica = launcher.start_service(
            "rollout",
            name="replica-token",
            overrides=[
                *common,
                "rlmesh.rollout.port=0",
                "rlmesh.rollout.metrics_port=0",
                f"rlmesh.reward.addresses=['{reward.grpc_address}']",
                "rlmesh.reference.colocated=true",  # the replica calls no reference service
                "actor_rollout_ref.rollout.response_length=8",
                "actor_rollout_ref.rollout.ignore_eos=true",
                "rlmesh.sampler.replica_id=replica-token",
            ],
            timeout_s=180,
        )
        asyncio.run(generate_and_push(redis.url, target))
        # What `rlmesh train` reports of each engine, through Rollout.GetInfo and the engine's API.
        assert engine_server_info(replica.grpc_address, TOKEN)["weight_version"] == "7"
        # redis, reward, the replica, and the replica's children: its engine among them
        cmdlines = [
            Path(f"/proc/{pid}/cmdline").read_bytes()
            for pid in [*(p.pid for p in launcher.processes), *children(replica.process.pid)]
        ]
        assert any(b"rlmesh.cli\0engine\0" in c for c in cmdlines)
        for cmdline in cmdlines:
            assert TOKEN.encode() not in cmdline and REDIS_PASSWORD.encode() not in cmdline
        launcher.stop(replica.process)
        logs = "".join(p.log_path.read_text(errors="replace") for p in launcher.processes)
    assert "replica-token" in logs and TOKEN not in logs and REDIS_PASSWORD not in logs
