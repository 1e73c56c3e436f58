"""benchmarks/bench_async.py: its modes are valid configs that differ only where they say, and
its summary measures each mode against the synchronous run of the same seed."""

import sys

import pytest

from rlmesh.config import load_config
from tests.support.repo import CPU_DEMO, REPO

sys.path.insert(0, str(REPO))
from benchmarks.bench_async import MODES, RESPONSE_LENGTH, overrides, summarize
from benchmarks.bench_peer import as_cli


@pytest.fixture
def prep(tmp_path):
    return {"data": tmp_path / "data", "model": tmp_path / "model"}


def config_of(prep, mode, tmp_path):
    return load_config(str(CPU_DEMO), as_cli(overrides(prep, mode, 1, 40, tmp_path / mode)))


def test_the_modes_differ_only_in_staleness_partial_rollouts_the_pause_and_over_provisioning(prep, tmp_path):
    sync, stale1, partial = (config_of(prep, m, tmp_path) for m in ("sync", "stale1", "partial"))
    assert (sync.rlmesh.max_staleness, stale1.rlmesh.max_staleness, partial.rlmesh.max_staleness) == (0, 1, 1)
    assert (
        stale1.algorithm.rollout_correction.rollout_is
        == "token"
        == partial.algorithm.rollout_correction.rollout_is
    )
    assert (stale1.rlmesh.sampler.partial_chunk_tokens, partial.rlmesh.sampler.partial_chunk_tokens) == (
        0,
        48,
    )
    assert partial.rlmesh.weight_sync.pause_mode == "in_place"
    for cfg in (sync, stale1, partial):  # the task and the learner the same
        assert cfg.algorithm.adv_estimator == "grpo" and cfg.data.max_response_length == RESPONSE_LENGTH
        assert cfg.actor_rollout_ref.rollout.n == 4 and cfg.data.train_batch_size == 32
        val = cfg.actor_rollout_ref.rollout.val_kwargs  # avg@8 at the training temperature
        assert (val.n, val.do_sample, val.temperature) == (8, True, cfg.actor_rollout_ref.rollout.temperature)
    over = config_of(prep, "over", tmp_path)
    assert over.rlmesh.max_staleness == 1 and over.algorithm.rollout_correction.rollout_is == "token"
    assert (stale1.rlmesh.over_provision, over.rlmesh.over_provision) == (0.0, 0.5)
    assert (
        over.rlmesh.sampler.partial_chunk_tokens == 0
        and over.rlmesh.weight_sync.pause_mode == stale1.rlmesh.weight_sync.pause_mode
    )
    assert set(MODES) == {"sync", "stale1", "partial", "over"}
    greedy = load_config(
        str(CPU_DEMO), as_cli(overrides(prep, "sync", 1, 40, tmp_path / "g", eval_samples=0))
    )
    assert greedy.actor_rollout_ref.rollout.val_kwargs.do_sample is False


def run(accs, step_s=10.0):
    evals = [{"step": 5 * i, "acc": a, "train_s": 5 * i * step_s} for i, a in enumerate(accs)]
    return {
        "evals": evals,
        "final_acc": sum(accs[-2:]) / 2,
        "train_s": evals[-1]["train_s"],
        "tokens_per_s": 100.0,
        "occupancy_mean": 3.0,
        "idle_share": 0.1,
    }


def test_each_mode_is_timed_to_the_synchronous_runs_final_accuracy_of_its_seed():
    results = {
        "0": {"sync": run([0.1, 0.2, 0.3, 0.4]), "partial": run([0.1, 0.35, 0.4, 0.5], step_s=8.0)},
        "1": {"sync": run([0.2, 0.2, 0.3]), "partial": run([0.2, 0.2, 0.2])},
        "2": {"sync": run([0.3, 0.2, 0.3]), "partial": run([0.3, 0.4, 0.5])},
    }
    s = summarize(results)
    # seed 0: sync's final (its last two) is 0.35, and its running mean of two gets there at step
    # 15 (150 s); partial's one evaluation of 0.35 at step 5 is not its level: (0.35 + 0.4) / 2 at
    # step 10 (80 s) is
    assert s["0"]["sync"]["to_sync_final_s"] == 150.0 and s["0"]["sync"]["ratio_to_sync"] == 1.0
    assert s["0"]["partial"]["to_sync_final_s"] == 80.0
    assert s["0"]["partial"]["ratio_to_sync"] == pytest.approx(80 / 150)
    # A lift of 0.25 over 128 greedy prompts is far past two standard errors (2 x 0.027)
    assert s["0"]["sync"]["sync_lift_significant"] is True
    # seed 1: partial never reaches sync's 0.25: no ratio, not a fast one
    assert s["1"]["partial"]["to_sync_final_s"] is None and s["1"]["partial"]["ratio_to_sync"] is None
    # seed 1: sync's 0.2 -> 0.25 is within two standard errors (2 x 0.035): flagged as noise
    assert s["1"]["sync"]["sync_lift_significant"] is False
    # seed 2: sync ends at 0.25, below its start of 0.3: nothing to reach, no ratio for any mode
    assert s["2"]["sync"]["ratio_to_sync"] is None and s["2"]["partial"]["ratio_to_sync"] is None
    # seed 1's lift with 8 answers a prompt: 2 x 0.0125 standard errors, 0.05 is past them
    sampled = {"1": {"sync": {**results["1"]["sync"], "eval_samples": 8}}}
    assert summarize(sampled)["1"]["sync"]["sync_lift_significant"] is True
