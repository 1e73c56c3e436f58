"""One PPO step in this process (ZeRO stage 0, one rank, fp32, a tiny Qwen2)."""

from __future__ import annotations

import logging

import pytest
import torch

from rlmesh.algo import POLICY_LOSS_REGISTRY, AdaptiveKLController
from rlmesh.learner import BatchError, PPOTrainer, build_batch
from tests.support.learner import PAD, make_config, make_trajectories, module_state


def _seq_log_probs(trainer, batch) -> torch.Tensor:
    log_probs, _ = trainer.compute_log_prob(batch)
    return (log_probs * batch.response_mask).sum(dim=1)


def test_one_step_raises_positive_and_lowers_negative_advantage_responses(tiny_model_dir):
    # One mini-batch, one epoch (verl's on-policy case); GRPO: score 1 -> A > 0, score 0 -> A < 0.
    cfg = make_config(
        tiny_model_dir,
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
    )
    trainer = PPOTrainer(cfg, total_training_steps=10)
    batch = build_batch(make_trajectories(seed=1, with_ref=False), PAD)
    before = _seq_log_probs(trainer, batch)
    metrics = trainer.train_step(batch)
    after = _seq_log_probs(trainer, batch)
    positive = batch.scores > 0.5
    assert positive.any() and (~positive).any()
    assert (after[positive] > before[positive]).all(), (before, after)
    assert (after[~positive] < before[~positive]).all(), (before, after)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/lr", "critic/score/mean",
                "response_length/mean", "timing_s/update_actor", "training/rollout_logprob_abs_diff"):  # fmt: skip
        assert key in metrics
    assert metrics["actor/lr"] == pytest.approx(1e-3)
    assert metrics["actor/skipped_steps"] == 0.0


def test_rollout_log_probs_never_replace_the_recomputed_old_log_probs(tiny_model_dir):
    # max_staleness = 0 is verl's synchronous PPO: the ratio is against the actor's own log-probs.
    # Garbage rollout log-probs (without IS correction) must change nothing but the mismatch metric.
    cfg = make_config(tiny_model_dir)
    good = make_trajectories(seed=2)
    bad = make_trajectories(seed=2)
    for t in bad:
        t.rollout_log_probs[:] = [-30.0] * len(t.response_ids)
    results = []
    for trajectories in (good, bad):
        trainer = PPOTrainer(cfg, total_training_steps=10)
        metrics = trainer.train_step(build_batch(trajectories, PAD))
        results.append((metrics, module_state(trainer.actor.engine)))
    (m_good, w_good), (m_bad, w_bad) = results
    assert m_good["actor/pg_loss"] == m_bad["actor/pg_loss"]
    assert all(torch.equal(w_good[n], w_bad[n]) for n in w_good)
    assert m_bad["training/rollout_logprob_abs_diff"] > 20 > m_good["training/rollout_logprob_abs_diff"]


def test_kl_in_reward_uses_and_updates_the_controller(tiny_model_dir):
    cfg = make_config(tiny_model_dir, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive")
    trainer = PPOTrainer(cfg, total_training_steps=10)
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.01, horizon=10)
    metrics = trainer.train_step(build_batch(make_trajectories(seed=4), PAD), ctrl)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert metrics["actor/reward_kl_penalty"] > 0.01  # random model vs random "reference"
    assert ctrl.value > 0.5  # KL above target: the coefficient grows
    assert metrics["critic/rewards/mean"] < metrics["critic/score/mean"]
    trainer.update_hyperparams(kl_coef=0.125)
    metrics = trainer.train_step(build_batch(make_trajectories(seed=5), PAD), ctrl)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.125


def test_nan_score_is_refused_before_the_loss(tiny_model_dir):
    trajectories = make_trajectories(seed=6)
    trajectories[3].score = float("nan")
    with pytest.raises(BatchError, match=r"p1/1.*score"):
        build_batch(trajectories, PAD)
    # A batch that got a NaN score some other way is refused by train_step, nothing trained.
    batch = build_batch(make_trajectories(seed=6), PAD)
    batch.token_level_scores[2, 0] = float("nan")
    trainer = PPOTrainer(make_config(tiny_model_dir), total_training_steps=10)
    before = module_state(trainer.actor.engine)
    with pytest.raises(BatchError, match="score"):
        trainer.train_step(batch)
    batch = build_batch(make_trajectories(seed=6), PAD)
    batch.input_ids[1, batch.prompt_length] = batch.responses[1, 0] = 150  # not in the vocabulary
    with pytest.raises(BatchError, match="vocabulary"):
        trainer.train_step(batch)
    after = module_state(trainer.actor.engine)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("stage", [0, 2])
def test_non_finite_loss_skips_the_step_with_a_clear_error(tiny_model_dir, monkeypatch, caplog, stage):
    # Stage 0 (fp32) is checked by the trainer; ZeRO stages by DeepSpeed's own overflow check.
    # The actor looks its loss up by policy_loss.loss_mode: replace the registered "vanilla".
    real = POLICY_LOSS_REGISTRY["vanilla"]

    def nan_policy_loss(*args, **kwargs):
        pg_loss, *rest = real(*args, **kwargs)
        return (pg_loss * float("nan"), *rest)

    monkeypatch.setitem(POLICY_LOSS_REGISTRY, "vanilla", nan_policy_loss)
    cfg = make_config(tiny_model_dir, estimator="gae", stage=stage)
    trainer = PPOTrainer(cfg, total_training_steps=10)
    before = module_state(trainer.actor.engine)
    critic_before = module_state(trainer.critic.engine)
    with caplog.at_level(logging.ERROR, logger="rlmesh.learner"):
        metrics = trainer.train_step(build_batch(make_trajectories(seed=7), PAD))
    after = module_state(trainer.actor.engine)
    assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step changed the actor"
    assert metrics["actor/skipped_steps"] == 2.0  # both mini-batches
    assert trainer.skipped_steps == 2 and metrics["training/skipped_steps"] == 2.0
    assert "optimizer step skipped" in caplog.text and "non-finite loss" in caplog.text
    # The critic's loss was finite: it trained as usual.
    assert metrics["critic/skipped_steps"] == 0.0
    assert any(not torch.equal(critic_before[n], w) for n, w in module_state(trainer.critic.engine).items())


def test_bypass_mode_takes_the_rollout_log_probs_as_the_old_ones(tiny_model_dir):
    # verl's bypass mode: no recompute pass. Rollout log-probs equal to the actor's own give the same
    # step as the recompute; garbage ones change it (they are used); a row without any is refused.
    trajectories = make_trajectories(seed=8)
    probe = PPOTrainer(make_config(tiny_model_dir), total_training_steps=10)
    own, _ = probe.compute_log_prob(build_batch(trajectories, PAD))
    for i, t in enumerate(trajectories):
        t.rollout_log_probs[:] = own[i, : len(t.response_ids)].tolist()
    results = {}
    for bypass in (False, True):
        cfg = make_config(tiny_model_dir, f"algorithm.rollout_correction.bypass_mode={bypass}")
        trainer = PPOTrainer(cfg, total_training_steps=10)
        metrics = trainer.train_step(build_batch(trajectories, PAD))
        results[bypass] = (metrics, module_state(trainer.actor.engine))
    (m_recompute, w_recompute), (m_bypass, w_bypass) = results[False], results[True]
    assert "timing_s/old_log_prob" in m_recompute and "timing_s/old_log_prob" not in m_bypass
    assert m_bypass["actor/pg_loss"] == pytest.approx(m_recompute["actor/pg_loss"], abs=1e-6)
    for name, weight in w_recompute.items():
        torch.testing.assert_close(w_bypass[name], weight, rtol=0, atol=1e-6, msg=name)

    cfg = make_config(tiny_model_dir, "algorithm.rollout_correction.bypass_mode=true")
    shifted = make_trajectories(seed=8)
    for t in shifted:
        t.rollout_log_probs[:] = [lp - 0.5 for lp in t.rollout_log_probs]
    m_shifted = PPOTrainer(cfg, total_training_steps=10).train_step(build_batch(shifted, PAD))
    assert m_shifted["actor/pg_loss"] != pytest.approx(m_bypass["actor/pg_loss"], abs=1e-4)

    missing = make_trajectories(seed=8)
    del missing[5].rollout_log_probs[:]
    trainer = PPOTrainer(cfg, total_training_steps=10)
    before = module_state(trainer.actor.engine)
    with pytest.raises(BatchError, match=r"p2/1.*rollout_log_probs.*bypass_mode"):
        trainer.train_step(build_batch(missing, PAD))
    after = module_state(trainer.actor.engine)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_critic_warmup_trains_only_the_critic_until_its_step(tiny_model_dir):
    # verl's rule: the actor trains at step s iff trainer.critic_warmup <= s; 3 -> steps 1, 2 critic only.
    cfg = make_config(
        tiny_model_dir,
        "trainer.critic_warmup=3",
        estimator="gae",
    )
    trainer = PPOTrainer(cfg, total_training_steps=10)
    for step in (1, 2, 3):
        actor_before = module_state(trainer.actor.engine)
        critic_before = module_state(trainer.critic.engine)
        scheduled_before = trainer.actor.scheduler.last_epoch
        metrics = trainer.train_step(build_batch(make_trajectories(seed=10 + step), PAD))
        actor_moved = any(
            not torch.equal(actor_before[n], w) for n, w in module_state(trainer.actor.engine).items()
        )
        critic_moved = any(
            not torch.equal(critic_before[n], w) for n, w in module_state(trainer.critic.engine).items()
        )
        assert critic_moved and "critic/vf_loss" in metrics
        assert actor_moved == (step >= 3), step
        assert ("actor/pg_loss" in metrics) == (step >= 3)
        assert metrics["training/actor_updated"] == float(step >= 3)
        # The actor's lr schedule does not advance while it does not train.
        assert trainer.actor.scheduler.last_epoch - scheduled_before == (step >= 3)


def test_a_live_kl_loss_coef_changes_the_actors_update(tiny_model_dir):
    # The same batch from the same weights: only the KL-loss weight, set live, differs.
    cfg = make_config(tiny_model_dir, "actor_rollout_ref.actor.use_kl_loss=true")
    batch = build_batch(make_trajectories(seed=20), PAD)
    states = []
    for coef in (0.0, 5.0):
        trainer = PPOTrainer(cfg, total_training_steps=10)
        trainer.update_hyperparams(kl_loss_coef=coef)
        metrics = trainer.train_step(batch)
        assert trainer.actor.kl_loss_coef == coef and metrics["actor/kl_loss"] > 0
        states.append(module_state(trainer.actor.engine))
    assert any(not torch.equal(states[0][n], states[1][n]) for n in states[0])
