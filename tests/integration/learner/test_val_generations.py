"""Validation against a real gRPC rollout server (a fake engine that echoes the prompt and the
sample index) keeps every sample, and ``trainer.log_val_generations`` of them reach the JSONL
sink: exactly N, and none for 0."""

from __future__ import annotations

import json

import pytest

from rlmesh.config import load_config
from rlmesh.learner.run.sinks import VAL_GENERATIONS_FILE, MetricsSinks
from rlmesh.learner.run.validation import run_validation, select_generations, val_sampling
from rlmesh.reward.failures import RewardErrorRule
from rlmesh.v1 import common_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc
from tests.support.data import prompt_items
from tests.support.learner import serve_rollout


class EchoRollout(rollout_pb2_grpc.RolloutServicer):
    """Answers each prompt with its own tokens then the sample index."""

    async def Generate(self, request, context):
        return rollout_pb2.GenerateResponse(
            outputs=[
                rollout_pb2.GenerateOutput(uid=i.uid, sample_index=k, output_ids=[*i.prompt_ids, k])
                for i in request.inputs
                for k in range(request.sampling_params.n)
            ]
        )


@pytest.fixture
async def replica():
    async with serve_rollout(EchoRollout()) as address:
        yield address


async def score(samples):
    """1 when the response's last token is the sample index 1, else 0; prompt 3 fails to score."""
    return [
        reward_pb2.RewardResult(
            uid=s.uid,
            score=float(s.response_ids[-1] == 1),
            error=common_pb2.SampleError(code=1, message="boom") if s.prompt_text == "p3" else None,
        )
        for s in samples
    ]


def decode(ids):
    return " ".join(str(i) for i in ids)


def config(*overrides):
    return load_config(None, ["actor_rollout_ref.rollout.val_kwargs.n=2", *overrides])


async def validation(replica, cfg, count=10):
    rollout = cfg.actor_rollout_ref.rollout
    return await run_validation(
        prompt_items(count),
        replicas=[replica],
        score=score,
        decode=decode,
        sampling=val_sampling(rollout.val_kwargs, 4),
        batch_size=3,  # several chunks, answered in any order
    )


async def test_a_validation_keeps_every_sample_with_its_prompt_answer_score_and_truth(replica):
    result = await validation(replica, config())
    samples = result.samples
    assert [(s.index, s.sample_index) for s in samples] == [(i, k) for i in range(10) for k in range(2)]
    for s in samples:
        assert s.input == f"p{s.index}" and s.ground_truth == str(s.index)
        assert s.output == f"{s.index + 1} {s.sample_index}" and s.data_source == "arithmetic"
        assert s.score == (0.0 if s.index == 3 else float(s.sample_index == 1))
    assert result.metrics["val/score"] == pytest.approx(sum(s.score for s in samples) / 20)
    assert result.metrics["val/score/arithmetic"] == result.metrics["val/score"]


async def test_log_val_generations_writes_exactly_that_many_samples_to_the_jsonl_sink(replica, tmp_path):
    cfg = config("trainer.log_val_generations=3")
    sinks = MetricsSinks(
        ["console"], jsonl_path=tmp_path / "metrics.jsonl", registry=None, project="p", experiment="e"
    )
    for step in (0, 5):
        result = await validation(replica, cfg)
        sinks.log_generations(step, select_generations(result.samples, cfg.trainer.log_val_generations))
    sinks.close()
    rows = [json.loads(line) for line in (tmp_path / VAL_GENERATIONS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 5]
    assert all(len(r["samples"]) == 3 for r in rows)
    # The same samples at every validation, each as validated.
    assert rows[0]["samples"] == rows[1]["samples"]
    for s in rows[0]["samples"]:
        assert s["input"] == f"p{s['index']}" and s["output"] == f"{s['index'] + 1} {s['sample_index']}"
        assert s["ground_truth"] == str(s["index"])
    assert len({(s["index"], s["sample_index"]) for s in rows[0]["samples"]}) == 3
    assert not (tmp_path / "metrics.jsonl").exists()  # generations are not step metrics


async def test_log_val_generations_0_writes_none(replica, tmp_path, capsys):
    cfg = config()
    assert cfg.trainer.log_val_generations == 0  # verl's default
    sinks = MetricsSinks(
        ["console"], jsonl_path=tmp_path / "metrics.jsonl", registry=None, project="p", experiment="e"
    )
    result = await validation(replica, cfg)
    sinks.log_generations(1, select_generations(result.samples, cfg.trainer.log_val_generations))
    sinks.close()
    assert not (tmp_path / VAL_GENERATIONS_FILE).exists()
    assert "validation generations" not in capsys.readouterr().out


async def test_more_generations_asked_than_validated_logs_them_all(replica, tmp_path):
    result = await validation(replica, config(), count=2)
    chosen = select_generations(result.samples, 50)
    assert sorted((s.index, s.sample_index) for s in chosen) == [(0, 0), (0, 1), (1, 0), (1, 1)]


async def validation_with(replica, rule):
    return await run_validation(
        prompt_items(10),
        replicas=[replica],
        score=score,
        decode=decode,
        sampling=val_sampling(config().actor_rollout_ref.rollout.val_kwargs, 4),
        batch_size=3,
        rule=rule,
    )


async def test_failed_rewards_in_validation_are_counted_and_scored_by_the_rule(replica):
    # Prompt 3's two samples fail to score: 2 of 20, reported, never a silent 0.0.
    result = await validation(replica, config())  # no rule: penalty 0.0
    assert result.metrics["val/reward/failed"] == 2.0
    assert result.metrics["val/reward/failed_ratio"] == pytest.approx(0.1)
    assert (result.failures.failed, result.failures.samples, result.failures.first) == (2, 20, "boom")

    penalised = await validation_with(replica, RewardErrorRule(error_score=-1.0))
    assert [s.score for s in penalised.samples if s.index == 3] == [-1.0, -1.0]
    assert penalised.metrics["val/score"] == pytest.approx((9 - 2) / 20)  # 9 right answers, 2 x -1

    dropped = await validation_with(replica, RewardErrorRule(on_error="drop"))
    assert dropped.metrics["val/score"] == pytest.approx(9 / 18)  # over the samples that scored
    assert dropped.metrics["val/reward/failed"] == 2.0
    rows = [s.row() for s in dropped.samples if s.index == 3]
    assert [r["score"] for r in rows] == [None, None]  # logged as null, not as 0.0
