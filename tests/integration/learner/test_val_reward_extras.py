"""Validation through a real gRPC rollout server logs verl's ``val-core``/``val-aux`` metrics: the
score as ``reward``, each extra value the reward returned as its own variable, per data source."""

from __future__ import annotations

import dataclasses

import pytest

from rlmesh.learner.run.validation import run_validation
from rlmesh.v1 import common_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc
from tests.support.data import prompt_items
from tests.support.learner import serve_rollout


class SampleIndexRollout(rollout_pb2_grpc.RolloutServicer):
    """Answers each prompt's k-th sample with the token k."""

    async def Generate(self, request, context):
        return rollout_pb2.GenerateResponse(
            outputs=[
                rollout_pb2.GenerateOutput(uid=i.uid, sample_index=k, output_ids=[k])
                for i in request.inputs
                for k in range(request.sampling_params.n)
            ]
        )


@pytest.fixture
async def replica():
    async with serve_rollout(SampleIndexRollout()) as address:
        yield address


async def score(samples):
    """Score 1 for sample 0 only; ``len`` is the sample index; ``odd`` only on odd prompts."""
    results = []
    for s in samples:
        k = s.response_ids[-1]
        extra = {"len": float(k), "bad key!": 1.0}
        if int(s.ground_truth) % 2:
            extra["odd"] = 1.0
        results.append(reward_pb2.RewardResult(uid=s.uid, score=float(k == 0), extra=extra))
    return results


async def validate(replica, items, n):
    return await run_validation(
        items,
        replicas=[replica],
        score=score,
        decode=lambda ids: " ".join(map(str, ids)),
        sampling=common_pb2.SamplingParams(max_new_tokens=1, n=n),
        batch_size=3,  # several chunks, answered in any order
    )


async def test_greedy_validation_logs_the_mean_of_the_score_and_of_each_extra_per_data_source(replica):
    items = prompt_items(6)
    items[4:] = [dataclasses.replace(it, data_source="other") for it in items[4:]]
    metrics = (await validate(replica, items, n=1)).metrics
    assert metrics["val-core/arithmetic/reward/mean@1"] == 1.0
    assert metrics["val-aux/arithmetic/len/mean@1"] == 0.0
    assert metrics["val-aux/arithmetic/bad_key_/mean@1"] == 1.0  # the name Prometheus takes
    assert metrics["val-aux/arithmetic/odd/mean@1"] == 1.0  # over the prompts that returned it
    assert metrics["val-core/other/reward/mean@1"] == 1.0
    assert metrics["val/score"] == 1.0 and metrics["val/score/other"] == 1.0  # rlmesh's own, unchanged
    assert not any("@" in k and not k.startswith(("val-core/", "val-aux/")) for k in metrics)


async def test_several_samples_per_prompt_give_verls_core_and_aux_statistics(replica):
    metrics = (await validate(replica, prompt_items(4), n=4)).metrics
    core = {k for k in metrics if k.startswith("val-core/")}
    assert core == {
        "val-core/arithmetic/reward/mean@4",
        "val-core/arithmetic/reward/best@4/mean",
        "val-core/arithmetic/reward/best@4/std",
    }
    assert metrics["val-core/arithmetic/reward/mean@4"] == 0.25  # one sample in four scores 1
    assert metrics["val-core/arithmetic/reward/best@4/mean"] == pytest.approx(1 - 0.75**4, abs=0.05)
    assert metrics["val-aux/arithmetic/reward/worst@2/mean"] == pytest.approx(1 / 16, abs=0.03)
    assert metrics["val-aux/arithmetic/len/mean@4"] == 1.5  # (0 + 1 + 2 + 3) / 4
    assert (
        metrics["val-aux/arithmetic/len/best@2/mean"] > 1.5 > metrics["val-aux/arithmetic/len/worst@2/mean"]
    )
    assert metrics["val/score"] == 0.25
