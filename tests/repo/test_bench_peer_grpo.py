"""benchmarks/bench_peer_grpo.py: TRL's side is given the knobs rlmesh's side runs with, and each run
is timed to the TRL run's final accuracy of its seed, with no ratio where TRL did not improve."""

import argparse
import sys

import pytest

from rlmesh.config import load_config
from tests.support.repo import CPU_DEMO, REPO

sys.path.insert(0, str(REPO))
from benchmarks.bench_async import overrides
from benchmarks.bench_peer import as_cli
from benchmarks.bench_peer_grpo import TRL_KNOBS, summarize, trl_argv


def test_trl_runs_the_batch_groups_mini_batches_lr_and_length_of_rlmeshs_run(tmp_path):
    prep = {"data": tmp_path / "data", "model": tmp_path / "model"}
    args = argparse.Namespace(
        steps=40, lr=2e-5, trl_python=".venv-trl-grpo/bin/python", trl_threads=1, eval_samples=8
    )
    flags = dict(
        a[2:].split("=", 1) for a in trl_argv(prep, 3, args, tmp_path / "trl.json") if a.startswith("--")
    )
    rlmesh = {**overrides(prep, "sync", 3, 40, tmp_path / "sync", lr=2e-5), **TRL_KNOBS}
    cfg = load_config(str(CPU_DEMO), as_cli(rlmesh))
    actor = cfg.actor_rollout_ref.actor
    assert int(flags["batch"]) == cfg.data.train_batch_size
    assert int(flags["n"]) == cfg.actor_rollout_ref.rollout.n
    assert (
        int(flags["mini-batches"])
        == cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    )
    assert float(flags["lr"]) == cfg.actor_rollout_ref.actor.optim.lr
    assert int(flags["response-length"]) == cfg.data.max_response_length
    assert int(flags["steps"]) == cfg.trainer.total_training_steps and int(flags["seed"]) == cfg.data.seed
    assert flags["model"] == str(prep["model"]) == cfg.actor_rollout_ref.model.path
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.use_kl_in_reward
    assert not actor.use_kl_loss  # TRL runs with beta = 0
    assert float(flags["clip-ratio"]) == actor.clip_ratio and actor.clip_ratio_c >= 1e9  # no dual-clip in TRL
    assert float(flags["weight-decay"]) == actor.optim.weight_decay
    assert (
        float(flags["warmup-ratio"]) == actor.optim.lr_warmup_steps_ratio and actor.optim.lr_warmup_steps <= 0
    )
    assert (
        float(flags["min-lr-ratio"]) == actor.optim.min_lr_ratio and actor.optim.lr_scheduler_type == "cosine"
    )
    assert actor.loss_agg_mode == "token-mean" and actor.grad_clip == 1.0 and not actor.entropy_coeff
    assert cfg.actor_rollout_ref.rollout.temperature == 1.0 and actor.ppo_epochs == 1
    val = cfg.actor_rollout_ref.rollout.val_kwargs  # both evaluate avg@8 at temperature 1 (TRL's default)
    assert int(flags["eval-samples"]) == val.n == 8 and val.do_sample and val.temperature == 1.0


def run(accs, step_s=10.0):
    evals = [{"step": 5 * i, "acc": a, "train_s": 5 * i * step_s} for i, a in enumerate(accs)]
    return {"evals": evals, "final_acc": sum(accs[-2:]) / 2, "train_s": evals[-1]["train_s"]}


def test_each_run_is_timed_to_trls_final_accuracy_and_no_ratio_where_trl_did_not_improve():
    results = {
        "0": {"trl": run([0.2, 0.3, 0.4, 0.5], step_s=20.0), "sync": run([0.2, 0.45, 0.5, 0.5])},
        "1": {"trl": run([0.3, 0.2, 0.3]), "sync": run([0.3, 0.4, 0.5])},
    }
    s = summarize(results)
    # seed 0: TRL's final (its last two) is 0.45, its running mean of two there at step 15 (300 s);
    # sync's at step 10, (0.45 + 0.5) / 2, after 100 s
    assert s["0"]["trl"]["to_trl_final_s"] == 300.0 and s["0"]["trl"]["ratio_to_trl"] == 1.0
    assert s["0"]["sync"]["to_trl_final_s"] == 100.0
    assert s["0"]["sync"]["ratio_to_trl"] == pytest.approx(100 / 300)
    assert s["0"]["trl"]["trl_lift_significant"] is True  # 0.25 over 128 prompts
    assert s["0"]["sync"]["s_per_step"] == pytest.approx(10.0)
    # seed 1: TRL ends at 0.25, below its start of 0.3: nothing to reach, so no ratio at all
    assert s["1"]["sync"]["ratio_to_trl"] is None and s["1"]["trl"]["ratio_to_trl"] is None
