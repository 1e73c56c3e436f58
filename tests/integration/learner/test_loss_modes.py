"""The actor trains with every policy loss of verl's registry (``policy_loss.loss_mode``).

A mini-batch cut into micro-batches of one sample gives the gradient of the same mini-batch in
one piece, for each mode: the global normalisation follows the aggregation the loss uses (sapo's
and geo_mean's mean over sequences, while the entropy and KL terms keep ``loss_agg_mode``'s). A
PPO step reports the mode's own metrics, under verl's names, and only those.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlmesh.algo import PG_METRICS, POLICY_LOSS_REGISTRY, policy_loss_info
from rlmesh.learner import PPOTrainer, build_batch
from tests.support.learner import PAD, first_step_gradient, make_config, make_trajectories

# clip_cov and kl_cov choose their tokens among each micro-batch's (as verl's): a split changes them.
SPLIT_INVARIANT = sorted(set(POLICY_LOSS_REGISTRY) - {"clip_cov", "kl_cov"})
SAMPLES = 8  # 4 prompts x 2


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    cfg = make_config(
        tiny_model_dir,
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={SAMPLES // 2}",  # one mini-batch
        "actor_rollout_ref.actor.grad_clip=0",  # the optimizer sees the accumulated gradient itself
    )
    return PPOTrainer(cfg, total_training_steps=100)


def use_mode(trainer: PPOTrainer, mode: str, **actor: object) -> None:
    """Switch the live actor to ``mode`` (and other actor keys), as the config would have set it."""
    config = trainer.actor.config
    policy_loss = config.policy_loss.model_copy(update={"loss_mode": mode, "dro_beta": 0.1})
    trainer.actor.config = config.model_copy(update={"policy_loss": policy_loss, **actor})


def gradient(trainer: PPOTrainer, batch, inputs, micro: int) -> dict[str, torch.Tensor]:
    """The gradient of the whole batch as one mini-batch, in micro-batches of ``micro`` samples.
    Two epochs, so the first is off-policy: the ratio is taken against ``inputs``' old log-probs."""
    mode = trainer.actor.config.policy_loss.loss_mode
    use_mode(trainer, mode, ppo_micro_batch_size_per_gpu=micro, ppo_epochs=2)
    old, advantages, weights = inputs
    return first_step_gradient(trainer.actor, batch, old, advantages, weights, 1)


@pytest.mark.parametrize("mode", SPLIT_INVARIANT)
def test_micro_batches_give_the_mini_batch_gradient(trainer, mode):
    batch = build_batch(make_trajectories(n_prompts=4, n=2, seed=21), PAD)
    g = torch.Generator().manual_seed(3)
    mask = batch.response_mask
    own, _ = trainer.compute_log_prob(batch)
    # Old log-probs away from the current ones: ratios clip, gates and trust regions act.
    old = (own + torch.randn(mask.shape, generator=g) * 0.3) * mask
    advantages = torch.randn(mask.shape, generator=g) * mask
    weights = (0.5 + torch.rand(mask.shape, generator=g)) * mask
    use_mode(trainer, mode)
    whole = gradient(trainer, batch, (old, advantages, weights), micro=SAMPLES)
    split = gradient(trainer, batch, (old, advantages, weights), micro=1)
    assert sum(float(x.abs().sum()) for x in whole.values()) > 0
    for name, x in whole.items():
        torch.testing.assert_close(split[name], x, rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")


@pytest.mark.parametrize("mode", sorted(POLICY_LOSS_REGISTRY))
def test_a_step_reports_the_modes_metrics(trainer, mode):
    use_mode(trainer, mode, ppo_micro_batch_size_per_gpu=2, ppo_epochs=2)  # the second epoch is off-policy
    metrics = trainer.train_step(build_batch(make_trajectories(n_prompts=4, n=2, seed=22), PAD))
    reported = {key for key in PG_METRICS if key in metrics}
    assert reported == set(policy_loss_info(mode).metrics), mode  # e.g. none for gpg, as verl
    for key in ("actor/pg_loss", "actor/grad_norm", *reported):
        assert math.isfinite(metrics[key]), (mode, key)
    assert metrics["actor/skipped_steps"] == 0.0
    if mode == "kl_cov":  # verl's kl_cov reports mean |log ratio| as ppo_kl
        assert metrics["actor/ppo_kl"] > 0
