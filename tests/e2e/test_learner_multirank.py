"""The learner service as 2 data-parallel ranks — two OS processes, started with the environment
torchrun gives them or by rank 0 itself (``rlmesh.learner.ranks``), gloo on CPU — under DeepSpeed ZeRO-2 (actor and critic), with Redis, reward, reference
and a rollout replica each a real process.

Rank 0 serves gRPC and drives the run; rank 1 runs the collectives rank 0 announces. What could go
wrong and is checked: a rank that is not in a collective (the step hangs or fails); ranks whose
weights part (ZeRO-2 gives each rank one half of the optimizer's fp32 weights: the offline export
of a checkpoint merges both halves, the push sends rank 0's full copy, and the two must be the
same); a SIGTERM to every rank at once (torchrun, compose, a dying launcher) that kills rank 1
before rank 0's final checkpoint, a collective; a stop while rank 0 waits for a batch that fails
the run; a 2-rank checkpoint that does not resume under 2 ranks; a SIGTERM to rank 0 alone that
leaves rank 1 waiting; and a rank 1 that hangs for ever once rank 0 is gone.
"""

import json
import signal
import subprocess
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import redis
import torch
from safetensors.torch import load_file

from rlmesh.learner import latest_checkpoint
from rlmesh.learner.checkpoints.export import export_checkpoint
from rlmesh.queue import ROLLOUT_GROUP, RunKeys
from rlmesh.runtime.launcher import LearnerRanks, ProcessLauncher
from rlmesh.v1 import common_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2_grpc
from tests.support.polling import wait_until
from tests.support.processes import pid_alive
from tests.support.repo import CPU_DEMO
from tests.support.stack import engine_url, engine_weights, run_overrides, start_peers

pytestmark = pytest.mark.slow

RANKS = 2
SETTINGS = [
    "actor_rollout_ref.actor.deepspeed_config.zero_stage=2",
    "critic.deepspeed_config.zero_stage=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=100",  # no periodic checkpoint in these runs, but one when a run ends
]


def learner_status(address: str) -> learner_pb2.LearnerStatus:
    with grpc.insecure_channel(address) as channel:
        return learner_pb2_grpc.LearnerStub(channel).GetStatus(common_pb2.Empty(), timeout=10)


def engine_version(url: str) -> str:
    """The weight version the engine holds (the replica's own GetInfo hears of a push later)."""
    return str(httpx.get(f"{url}/get_model_info", timeout=10).json()["weight_version"])


def set_replica_paused(rollout_address: str, paused: bool) -> None:
    with grpc.insecure_channel(rollout_address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        ack = (stub.Pause if paused else stub.Resume)(common_pb2.Empty(), timeout=30)
        assert ack.success, ack.message


def unclaimed_prompts(redis_url: str, run_id: str) -> int:
    """Prompt tasks queued after the last one a replica claimed."""
    key = RunKeys(run_id).prompts
    with redis.Redis.from_url(redis_url) as r:  # raw bytes: the tasks are protobuf
        group = next(g for g in r.xinfo_groups(key) if g["name"] == ROLLOUT_GROUP.encode())
        return len(r.xrange(key, min=b"(" + group["last-delivered-id"], max="+"))


def wait_exit(group: LearnerRanks, timeout_s: float) -> list[int]:
    """Exit codes of rank 0, then the followers; fails naming the rank that did not exit."""
    codes = []
    for proc in group.processes:
        try:
            codes.append(proc.popen.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{proc.name} did not exit:\n{proc.log_tail(30)}") from e
    return codes


def exported_actor(checkpoint: str, out: Path) -> dict[str, torch.Tensor]:
    """The actor of a checkpoint as `rlmesh export` writes it (ZeRO partitions of all ranks merged)."""
    export_checkpoint(checkpoint, out)
    return load_file(out / "model.safetensors")


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for name, tensor in want.items():
        # Bit for bit: both are the same fp32 values, gathered from the ranks' ZeRO partitions.
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=f"{what}: {name}")


def max_change(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in b)


def test_two_ranks_train_stop_together_on_sigterm_and_resume(tmp_path, prepared):
    run_dir = tmp_path / "run"
    initial = load_file(prepared.model / "model.safetensors")
    with ProcessLauncher(tmp_path / "procs", stop_grace_s=30) as launcher:
        peers = start_peers(launcher, prepared, run_dir, SETTINGS)
        url = engine_url(peers.rollout.grpc_address)

        # Run 1: open-ended. After two steps the replica stops claiming tasks; once a step's tasks
        # sit unclaimed, rank 0 waits for a batch that cannot come. Then SIGTERM to both ranks, as
        # torchrun sends it: rank 0 gives up the wait, writes the final checkpoint with rank 1 (which
        # must outlive its own SIGTERM for that) and tells it to stop. Both exit 0.
        first = launcher.start_learner(
            RANKS,
            config_path=CPU_DEMO,
            overrides=[*peers.learner_overrides, "trainer.total_training_steps=50"],
        )
        wait_until(
            lambda: learner_status(first.rank0.grpc_address).step >= 2, 240, "two steps of the 2-rank learner"
        )
        set_replica_paused(peers.rollout.grpc_address, True)
        wait_until(
            lambda: unclaimed_prompts(peers.redis_url, peers.run_id) > 0,
            120,
            "a step the replica won't serve",
        )
        for proc in first.processes:
            proc.popen.send_signal(signal.SIGTERM)
        assert wait_exit(first, 120) == [0, 0], first.rank0.process.log_tail(30)
        assert "stopped while waiting for the batch of step" in first.rank0.process.log_path.read_text()
        follower_log = first.followers[0].log_path.read_text()
        assert "SIGTERM: rank 1 stops when rank 0 ends the run" in follower_log
        assert "rank 0 ended the run" in follower_log
        stopped_at = latest_checkpoint(str(run_dir))
        assert stopped_at is not None, first.rank0.process.log_tail(30)
        k = int(stopped_at.rsplit("_", 1)[1])
        assert k >= 2
        state = json.loads((Path(stopped_at) / "trainer_state.json").read_text())
        assert state["world_size"] == RANKS and state["zero_stage"] == {"actor": 2, "critic": 2}

        # The replica holds exactly what both ranks' partitions say the actor is, and it moved.
        assert engine_version(url) == str(k)
        want = exported_actor(stopped_at, tmp_path / "export1")
        pushed = engine_weights(url, sorted(want))
        assert_same_weights(pushed, want, f"push after step {k} vs its checkpoint")
        assert max_change(pushed, {n: initial[n] for n in want}) > 1e-4, "training did not move the actor"

        # Run 2: the same 2 ranks resume from that checkpoint, train one more step and finish.
        set_replica_paused(peers.rollout.grpc_address, False)
        second = launcher.start_learner(
            RANKS,
            name="learner2",
            config_path=CPU_DEMO,
            overrides=[*peers.learner_overrides, f"trainer.total_training_steps={k + 1}"],
        )
        assert wait_exit(second, 240) == [0, 0], second.rank0.process.log_tail(30)
        assert f"resuming from {stopped_at}" in second.rank0.process.log_path.read_text()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, k + 2))
        assert rows[-1]["training/policy_version"] == k + 1
        assert rows[-1]["training/dropped_stale"] == 0
        final = latest_checkpoint(str(run_dir))
        assert final is not None and final.endswith(f"global_step_{k + 1}")
        assert engine_version(url) == str(k + 1)
        want = exported_actor(final, tmp_path / "export2")
        resumed = engine_weights(url, sorted(want))
        assert_same_weights(resumed, want, f"push after step {k + 1} vs its checkpoint")
        assert max_change(resumed, pushed) > 1e-6, "the resumed step did not move the actor"


def test_rank_0_started_alone_runs_its_ranks_stops_them_and_rank_1_exits_when_rank_0_dies(tmp_path, prepared):
    # Rank 0 with Redis alone waits for a rollout replica that never comes; rank 1 waits for its
    # first command.
    with ProcessLauncher(tmp_path / "procs", stop_grace_s=30) as launcher:
        redis_server = launcher.start_redis()
        overrides = [
            *run_overrides("e2e-ranks", redis_server.url, prepared, tmp_path / "run", SETTINGS),
            "rlmesh.learner.port=0",
            "rlmesh.learner.metrics_port=0",
        ]

        def waiting_for_replicas(address: str, name: str) -> None:
            wait_until(
                lambda: learner_status(address).message == "no rollout replica registered yet",
                60,
                f"{name} to wait for replicas",
            )

        # Without a launcher, rlmesh.learner.ranks=2: the process started is rank 0 and starts
        # rank 1 as its child. SIGTERM to rank 0 alone: it tells rank 1 to stop and waits for it.
        rank0 = launcher.start_service(
            "learner", config_path=CPU_DEMO, overrides=[*overrides, f"rlmesh.learner.ranks={RANKS}"]
        )
        waiting_for_replicas(rank0.grpc_address, "learner")
        (follower,) = psutil.Process(rank0.process.pid).children()
        assert follower.environ()["RANK"] == "1" and follower.environ()["WORLD_SIZE"] == str(RANKS)
        rank0.process.popen.send_signal(signal.SIGTERM)
        assert rank0.process.popen.wait(timeout=60) == 0, rank0.process.log_tail(30)
        assert not psutil.pid_exists(follower.pid) or follower.status() == psutil.STATUS_ZOMBIE
        log_text = rank0.process.log_path.read_text()  # rank 1 writes where rank 0 does
        assert "learner rank 1 of 2 in the process group" in log_text
        assert "rank 0 ended the run" in log_text

        # Under a launcher's environment (torchrun's), SIGKILL to rank 0: it can say nothing; rank 1
        # must notice by itself, and exit 1.
        group = launcher.start_learner(RANKS, name="learner2", config_path=CPU_DEMO, overrides=overrides)
        waiting_for_replicas(group.rank0.grpc_address, "learner2")
        group.rank0.process.popen.send_signal(signal.SIGKILL)
        follower = group.followers[0]
        wait_until(lambda: not pid_alive(follower.pid), 60, "rank 1 to exit after rank 0 died")
        assert follower.popen.wait() == 1
        assert "rank 0 is gone" in follower.log_path.read_text()
