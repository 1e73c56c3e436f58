"""A ReMax PPO step in this process: the advantages the trainer logs are verl's ReMax definition
applied to the batch's greedy baselines and its KL-in-reward token rewards."""

from __future__ import annotations

import pytest
import torch

from rlmesh.learner import BatchError, PPOTrainer, build_batch
from tests.support.learner import PAD, make_config, make_trajectories, module_state

BETA = 0.5
BASELINES = {"p0": 0.25, "p1": 0.75, "p2": -0.5, "p3": 1.0}  # each prompt's greedy-response score


def remax_trajectories(seed: int):
    trajectories = make_trajectories(seed=seed)
    for t in trajectories:
        t.baseline_score = BASELINES[t.group_uid]
    return trajectories


def test_remax_advantages_are_the_reward_to_go_with_kl_minus_the_greedy_baseline(tiny_model_dir):
    cfg = make_config(
        tiny_model_dir,
        "algorithm.use_kl_in_reward=true",
        f"algorithm.kl_ctrl.kl_coef={BETA}",
        estimator="remax",
    )
    assert not cfg.uses_critic()
    trainer = PPOTrainer(cfg, total_training_steps=10)
    batch = build_batch(remax_trajectories(seed=3), PAD)
    old_log_probs, _ = trainer.compute_log_prob(batch)  # what the step computes first, same weights
    metrics = trainer.train_step(batch)

    # verl's definition, token by token: r_t = score on the last token - beta * (log pi - log pi_ref),
    # R_t = sum of r over t' >= t, A_t = R_t - b (the baseline carries no KL).
    advantages, returns = [], []
    for i, t in enumerate(batch.uids):
        length = int(batch.response_mask[i].sum())
        rewards = [-BETA * float(old_log_probs[i, k] - batch.ref_log_probs[i, k]) for k in range(length)]
        rewards[-1] += float(batch.scores[i])
        baseline = BASELINES[t.split("/")[0]]
        for k in range(length):
            reward_to_go = sum(rewards[k:])
            returns.append(reward_to_go)
            advantages.append(reward_to_go - baseline)
    for name, values in (("advantages", advantages), ("returns", returns)):
        assert metrics[f"critic/{name}/mean"] == pytest.approx(sum(values) / len(values), abs=1e-5)
        assert metrics[f"critic/{name}/max"] == pytest.approx(max(values), abs=1e-5)
        assert metrics[f"critic/{name}/min"] == pytest.approx(min(values), abs=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == BETA
    assert not [k for k in metrics if k.startswith("critic/vf_")]  # no critic


def test_a_remax_batch_without_baselines_is_refused_before_the_loss(tiny_model_dir):
    trainer = PPOTrainer(make_config(tiny_model_dir, estimator="remax"), total_training_steps=10)
    before = module_state(trainer.actor.engine)
    with pytest.raises(BatchError, match=r"baseline_score.*remax"):
        trainer.train_step(build_batch(make_trajectories(seed=4), PAD))
    batch = build_batch(remax_trajectories(seed=4), PAD)
    batch.reward_baselines[1] = float("inf")
    with pytest.raises(BatchError, match=r"p0/1.*baseline_score.*not finite"):
        trainer.train_step(batch)
    after = module_state(trainer.actor.engine)
    assert all(torch.equal(before[n], after[n]) for n in before)
