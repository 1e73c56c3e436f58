"""A PPO step's metrics that need the trainer, recomputed from verl 0.9.1's definitions."""

from __future__ import annotations

import pytest

from rlmesh.learner import PPOTrainer, build_batch
from tests.support.learner import PAD, make_config, make_trajectories

MAX_RESPONSE = 16  # wider than any response make_trajectories draws (at most 8 tokens)


def test_entropy_is_verls_agg_loss_over_the_configured_length(tiny_model_dir):
    # verl: actor/entropy = agg_loss(entropys, response_mask, loss_agg_mode, loss_scale_factor);
    # seq-mean-token-sum-norm divides by loss_scale_factor, else by the padded width, which verl
    # pads to rollout.response_length; this batch is narrower than that.
    cfg = make_config(
        tiny_model_dir,
        f"data.max_response_length={MAX_RESPONSE}",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
    )
    trainer = PPOTrainer(cfg, total_training_steps=10)
    batch = build_batch(make_trajectories(seed=5, with_ref=False), PAD)
    assert batch.response_length < MAX_RESPONSE
    _, entropys = trainer.compute_log_prob(batch)  # what the step computes first, same weights
    mask = batch.response_mask.tolist()
    sums = [
        sum(e for e, m in zip(row, mrow, strict=True) if m)
        for row, mrow in zip(entropys.tolist(), mask, strict=True)
    ]
    valid = [s for s, mrow in zip(sums, mask, strict=True) if any(mrow)]
    expected = sum(valid) / len(valid) / MAX_RESPONSE

    metrics = trainer.train_step(batch)

    assert metrics["actor/entropy"] == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/entropy"] != pytest.approx(
        sum(valid) / len(valid) / batch.response_length, rel=1e-3
    )
    # the data metrics' maxima are the configured lengths, not the batch's widths
    assert metrics["response_length/clip_ratio"] == 0.0
    prompts = batch.attention_mask[:, : batch.prompt_length].sum(dim=1).tolist()
    assert metrics["prompt_length/clip_ratio"] == pytest.approx(sum(n == 12 for n in prompts) / len(prompts))
