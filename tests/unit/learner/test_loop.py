"""The loop's verl metrics that need no running loop: perf/throughput's GPU count and
timing_per_token_ms (verl's compute_timing_metrics / compute_throughout_metrics)."""

from __future__ import annotations

import pytest

from rlmesh.config import load_config
from rlmesh.learner.run.step_metrics import job_gpus, timing_per_token_ms


def test_job_gpus_counts_cuda_learner_ranks_and_sglang_replicas() -> None:
    cpu = load_config(None, ["actor_rollout_ref.rollout.name=embedded", "rlmesh.learner.ranks=2"], warn=False)
    assert job_gpus(cpu, cuda=False) == 1  # a CPU-only run divides by one
    assert job_gpus(cpu, cuda=True) == 2
    gpu = load_config(
        None,
        [
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "rlmesh.rollout.replicas=3",
            "rlmesh.learner.ranks=4",
        ],
        warn=False,
    )
    assert job_gpus(gpu, cuda=True) == 4 + 3 * 2
    on_cpu = gpu.model_copy(update={"trainer": gpu.trainer.model_copy(update={"device": "cpu"})})
    assert job_gpus(on_cpu, cuda=True) == 3 * 2


def test_timing_per_token_ms_as_verl() -> None:
    # verl: gen per response token; ref, values, adv, update_critic, update_actor per prompt+response
    # token; other phases get none.
    metrics = {"timing_s/gen": 2.0, "timing_s/update_actor": 3.0, "timing_s/push_weights": 1.0}
    out = timing_per_token_ms(metrics, response_tokens=400, tokens=1000)
    assert out == {
        "timing_per_token_ms/gen": pytest.approx(2.0 * 1000 / 400),
        "timing_per_token_ms/update_actor": pytest.approx(3.0 * 1000 / 1000),
    }
    assert timing_per_token_ms(metrics, 0, 0) == {
        "timing_per_token_ms/gen": 0.0,
        "timing_per_token_ms/update_actor": 0.0,
    }
