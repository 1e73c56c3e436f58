"""The learner service with every other service, each a real process: a short PPO run, the
weight push, checkpoints and the Learner control RPCs."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.learner import latest_checkpoint
from rlmesh.queue import RunKeys, connect
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import common_pb2, learner_pb2, learner_pb2_grpc
from tests.support.polling import wait_until
from tests.support.processes import child_env
from tests.support.repo import CPU_DEMO, REPO
from tests.support.stack import engine_url, start_peers


def start_stack(launcher, prepared, run_dir, extra):
    peers = start_peers(launcher, prepared, run_dir, extra)
    learner = launcher.start_service(
        "learner", config_path=CPU_DEMO, timeout_s=300, overrides=peers.learner_overrides
    )
    learner.rollout_address = peers.rollout.grpc_address
    return learner, peers.common


async def run_key_ttls(common: list[str]) -> dict[bytes, int]:
    given = dict(o.split("=", 1) for o in common if o.startswith(("rlmesh.run_id=", "rlmesh.redis_url=")))
    redis = connect(given["rlmesh.redis_url"])
    try:
        keys = RunKeys(given["rlmesh.run_id"])
        return {key: await redis.ttl(key) async for key in redis.scan_iter(match=f"{keys.prefix}:*")}
    finally:
        await redis.aclose()


def test_a_short_run_trains_pushes_checkpoints_and_exits_cleanly(tmp_path, prepared):
    run_dir = tmp_path / "run"
    with ProcessLauncher(tmp_path / "procs", stop_grace_s=30) as launcher:
        learner, common = start_stack(
            launcher,
            prepared,
            run_dir,
            ["trainer.total_training_steps=3", "trainer.save_freq=2", "trainer.test_freq=3"],
        )
        assert learner.process.popen.wait(timeout=600) == 0, learner.process.log_tail(40)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2, 3]  # validation before training, then 3 steps
        for key in (
            "actor/pg_loss",
            "actor/pg_clipfrac",
            "actor/ppo_kl",
            "actor/entropy",
            "actor/grad_norm",
            "actor/lr",
            "critic/vf_loss",
            "critic/score/mean",
            "actor/reward_kl_penalty",
            "actor/reward_kl_penalty_coeff",
            "response_length/mean",
            "timing_s/gen",
            "timing_s/push_weights",
            "timing_s/step",
            "perf/throughput",
        ):
            assert key in rows[1], key
        assert "val/score" in rows[0] and "val/score" in rows[3]
        assert rows[3]["training/policy_version"] == 3
        # Synchronous PPO: each step's samples come from the weights pushed just before, so none is
        # thrown away as stale (a replica tagging with a version it heard of late would do that).
        assert [r["training/dropped_stale"] for r in rows[1:]] == [0, 0, 0]
        checkpoint = latest_checkpoint(str(run_dir))
        assert checkpoint is not None and checkpoint.endswith("global_step_3")
        assert (Path(checkpoint).parent / "global_step_2").is_dir()
        # A finished run's Redis keys expire (rlmesh.queue.finished_run_ttl_s: 7 days by default).
        ttls = asyncio.run(run_key_ttls(common))
        assert ttls and all(0 < ttl <= 7 * 24 * 3600 for ttl in ttls.values()), ttls

        # The replica holds exactly the weights the learner ended with: its greedy output equals
        # that of the exported final actor.
        export = tmp_path / "export"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlmesh.cli",
                "export",
                "--checkpoint",
                checkpoint,
                "--out",
                str(export),
                "--config",
                str(CPU_DEMO),
                *common,
            ],
            capture_output=True,
            text=True,
            env=child_env(),
            cwd=REPO,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        prompts = [[10, 20, 30, 40], [5, 6, 7]]
        expected = []
        with torch.no_grad():
            for p in prompts:
                ids = list(p)
                for _ in range(6):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                expected.append(ids[len(p) :])
        body = {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        }
        got = [
            o["output_ids"]
            for o in httpx.post(
                engine_url(learner.rollout_address) + "/generate", json=body, timeout=60
            ).json()
        ]
        assert got == expected


def test_pause_checkpoint_hyperparams_and_stop_over_grpc(tmp_path, prepared):
    run_dir = tmp_path / "run"
    with ProcessLauncher(tmp_path / "procs", stop_grace_s=30) as launcher:
        learner, _ = start_stack(
            launcher,
            prepared,
            run_dir,
            [
                "trainer.total_training_steps=500",
                "trainer.save_freq=-1",
                "trainer.test_freq=-1",
                "trainer.val_before_train=false",
                "actor_rollout_ref.actor.optim.warmup_ratio=0",
                # A new lr is the schedule's base: a constant schedule makes it the rate itself.
                "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
            ],
        )
        with grpc.insecure_channel(learner.grpc_address) as channel:
            stub = learner_pb2_grpc.LearnerStub(channel)
            wait_until(lambda: stub.GetStatus(common_pb2.Empty()).step >= 1, 300, "the first step")
            paused = stub.Pause(common_pb2.Empty())
            assert paused.paused
            wait_until(
                lambda: stub.GetStatus(common_pb2.Empty()).phase == learner_pb2.LEARNER_PHASE_PAUSED,
                120,
                "the learner to hold",
            )
            held = stub.GetStatus(common_pb2.Empty()).step
            saved = stub.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(), timeout=120)
            assert saved.step == held and Path(saved.path).name == f"global_step_{held}"
            assert stub.GetStatus(common_pb2.Empty()).step == held  # still holding
            update = stub.UpdateHyperparams(
                learner_pb2.UpdateHyperparamsRequest(actor_lr=3e-5, entropy_coeff=0.01)
            )
            assert update.applies_from_step == held + 1
            assert update.values["actor_rollout_ref.actor.optim.lr"] == pytest.approx(3e-5)
            with pytest.raises(grpc.RpcError) as bad:
                stub.UpdateHyperparams(learner_pb2.UpdateHyperparamsRequest(actor_lr=-1.0))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lr=-1.0" in bad.value.details()
            for value in (float("nan"), float("inf")):
                with pytest.raises(grpc.RpcError) as bad:
                    stub.UpdateHyperparams(learner_pb2.UpdateHyperparamsRequest(kl_coef=value))
                assert "must be a finite number" in bad.value.details()
            fuzz_the_learner_service(channel)
            # What the fuzz left pending is replaced before the run goes on.
            stub.UpdateHyperparams(
                learner_pb2.UpdateHyperparamsRequest(
                    actor_lr=3e-5,
                    entropy_coeff=0.01,
                    kl_coef=0.001,
                    temperature=1.0,
                    kl_loss_coef=0.001,
                    clip_ratio=0.2,
                    top_p=1.0,
                )
            )
            stub.Resume(common_pb2.Empty())
            wait_until(lambda: stub.GetStatus(common_pb2.Empty()).step > held, 300, "training to go on")
            status = stub.GetStatus(common_pb2.Empty())
            assert status.metrics["actor/lr"] == pytest.approx(3e-5)
            stub.Stop(learner_pb2.StopRequest(checkpoint=True))
        assert learner.process.popen.wait(timeout=300) == 0, learner.process.log_tail(40)
        last = latest_checkpoint(str(run_dir))
        assert last is not None and int(last.rsplit("_", 1)[1]) > held


def fuzz_the_learner_service(channel: grpc.Channel) -> None:
    """The learner's RPCs that change nothing but pending hyper-parameters, fuzzed as the other
    services are (``tests/fuzz/``): any message or bytes get OK or INVALID_ARGUMENT naming a field,
    and the learner answers on. (Pause, Stop and SaveCheckpoint act on the run: not fuzzed.)"""
    from hypothesis import given
    from hypothesis import strategies as st

    from tests.support.protostrategies import FUZZ, build, message_dicts, names_in

    methods = {
        "/rlmesh.v1.Learner/UpdateHyperparams": learner_pb2.UpdateHyperparamsRequest,
        "/rlmesh.v1.Learner/GetStatus": common_pb2.Empty,
    }

    def check(method: str, payload: bytes) -> None:
        try:
            channel.unary_unary(method)(payload, timeout=30)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {e.code().name}: {e.details()}"
            assert any(n in (e.details() or "") for n in names_in(methods[method].DESCRIPTOR)), e.details()

    @FUZZ
    @given(values=message_dicts(learner_pb2.UpdateHyperparamsRequest.DESCRIPTOR))
    def messages(values):
        check(
            "/rlmesh.v1.Learner/UpdateHyperparams",
            build(learner_pb2.UpdateHyperparamsRequest, values).SerializeToString(),
        )

    @FUZZ
    @given(method=st.sampled_from(sorted(methods)), payload=st.binary(max_size=200))
    def raw(method, payload):
        check(method, payload)

    messages()
    raw()
    assert learner_pb2_grpc.LearnerStub(channel).GetStatus(common_pb2.Empty(), timeout=30).paused
