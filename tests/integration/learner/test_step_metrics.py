"""A PPO step's metrics that need the trainer, recomputed from verl 0.9.1's definitions."""

from __future__ import annotations

import math

import pytest
import torch

from rlmesh.learner import PPOTrainer, build_batch
from rlmesh.learner.ppo.parallel import micro_batch_plan
from rlmesh.learner.ppo.partition import mini_batches
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


# Per-micro-batch metrics. 6 samples in mini-batches of 4 and 2 (ppo_mini_batch_size=2 prompts x 2),
# micro-batches of 2: the first mini-batch has 2 micro-batches, the second 1, and responses of 2-8
# tokens give micro-batches of unequal token counts. lr 0: every micro-batch of the update sees the
# weights compute_log_prob / compute_values saw, so the expected values can be recomputed from them.
FROZEN = (
    "actor_rollout_ref.actor.optim.lr=0.0",
    "critic.optim.lr=0.0",
    "critic.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.entropy_coeff=0.0",
)


@pytest.fixture(scope="module")
def frozen(tiny_model_dir):
    trainer = PPOTrainer(make_config(tiny_model_dir, *FROZEN, estimator="gae"), total_training_steps=10)
    batch = build_batch(make_trajectories(n_prompts=3, n=2, seed=8), PAD)
    return trainer, batch


def micro_batches_of(role, batch) -> list[list[list[int]]]:
    """The update's micro-batches (rows), grouped by mini-batch (one epoch, no shuffle, 1 rank)."""
    cfg = role.config
    size = int(cfg.ppo_mini_batch_size) * role.rollout_n
    return [
        micro_batch_plan(batch, rows, cfg.ppo_micro_batch_size_per_gpu, False, None, role.balance_batch)
        for rows in mini_batches(range(len(batch)), size)
    ]


def token_means(minis, mask, per_token) -> list[list[float]]:
    """Each micro-batch's mean of ``per_token(row, t)`` over its valid tokens, by mini-batch."""
    out = []
    for micros in minis:
        out.append([])
        for rows in micros:
            values = [per_token(r, t) for r in rows for t in range(len(mask[r])) if mask[r][t]]
            out[-1].append(sum(values) / len(values))
    return out


def token_weighted(minis, mask, per_token) -> float:
    """The old rlmesh reduction: one token mean over the whole update."""
    values = [
        per_token(r, t)
        for micros in minis
        for rows in micros
        for r in rows
        for t in range(len(mask[r]))
        if mask[r][t]
    ]
    return sum(values) / len(values)


def test_policy_loss_metrics_are_verls_micro_batch_means_averaged_over_mini_batches(frozen):
    # verl 0.9.1 (workers/utils/losses.py ppo_loss, workers/engine_workers.py train_mini_batch,
    # utils/metric reduce_metrics): the policy loss gives each micro-batch's token means
    # (Metric MEAN); Metric.aggregate_dp averages them over the micro-batches and ranks of a
    # mini-batch; the trainer's reduce_metrics averages the mini-batches.
    trainer, batch = frozen
    actor = trainer.actor
    actor.config = actor.config.model_copy(update={"ppo_epochs": 1, "shuffle": False})
    g = torch.Generator().manual_seed(11)
    log_probs, _ = trainer.compute_log_prob(batch)
    mask = batch.response_mask.bool().tolist()
    old = (log_probs + torch.randn(log_probs.shape, generator=g) * 1.5).tolist()  # some ratios > clip_ratio_c
    advantages = torch.randn(log_probs.shape, generator=g).tolist()
    lp = log_probs.tolist()
    cl, ch, c = actor.config.clip_ratio_low, actor.config.clip_ratio_high, actor.config.clip_ratio_c

    def log_ratio(r, t):
        return min(max(lp[r][t] - old[r][t], -20.0), 20.0)

    def clipped(r, t):  # -A·clip(ratio) > -A·ratio
        ratio, a = math.exp(log_ratio(r, t)), advantages[r][t]
        return float(-a * min(max(ratio, 1 - cl), 1 + ch) > -a * ratio)

    def clipped_lower(r, t):  # A < 0 and max(-A·ratio, -A·clip(ratio)) > -A·c
        ratio, a = math.exp(log_ratio(r, t)), advantages[r][t]
        return float(a < 0 and max(-a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch)) > -a * c)

    per_token = {
        "actor/pg_clipfrac": clipped,
        "actor/ppo_kl": lambda r, t: -log_ratio(r, t),
        "actor/pg_clipfrac_lower": clipped_lower,
    }
    minis = micro_batches_of(actor, batch)
    assert [len(m) for m in minis] == [2, 1]
    tokens = [sum(mask[r].count(True) for r in rows) for micros in minis for rows in micros]
    assert len(set(tokens)) > 1, tokens

    metrics = actor.update_policy(
        batch,
        torch.tensor(old) * batch.response_mask,
        torch.tensor(advantages) * batch.response_mask,
        None,
        step=1,
    )

    for key, fn in per_token.items():
        means = token_means(minis, mask, fn)
        expected = sum(sum(m) / len(m) for m in means) / len(means)
        assert metrics[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key
        # a case that tells verl's reduction from a token mean and from a flat micro-batch mean
        assert expected != pytest.approx(token_weighted(minis, mask, fn), abs=1e-3), key
        flat = [v for m in means for v in m]
        assert expected != pytest.approx(sum(flat) / len(flat), abs=1e-3), key
    assert metrics["actor/pg_clipfrac_lower"] > 0
    assert "actor/entropy_loss" not in metrics  # entropy_coeff 0 and calculate_entropy false


def test_calculate_entropy_logs_verls_entropy_loss_with_entropy_coeff_0(frozen):
    # verl: entropy in the update when calculate_entropy or entropy_coeff != 0; actor/entropy_loss
    # is agg_loss over the global mini-batch (token-mean here), averaged over the mini-batches.
    trainer, batch = frozen
    actor = trainer.actor
    actor.config = actor.config.model_copy(
        update={"calculate_entropy": True, "ppo_epochs": 1, "shuffle": False}
    )
    try:
        log_probs, entropy = trainer.compute_log_prob(batch)
        mask = batch.response_mask.bool().tolist()
        ent = entropy.tolist()
        minis = micro_batches_of(actor, batch)
        per_mini = []
        for micros in minis:
            values = [ent[r][t] for rows in micros for r in rows for t in range(len(mask[r])) if mask[r][t]]
            per_mini.append(sum(values) / len(values))
        advantages = (
            torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(2)) * batch.response_mask
        )

        metrics = actor.update_policy(batch, log_probs, advantages, None, step=1)

        assert metrics["actor/entropy_loss"] == pytest.approx(sum(per_mini) / len(per_mini), rel=1e-5)
    finally:
        actor.config = actor.config.model_copy(update={"calculate_entropy": False})


def test_value_metrics_are_verls_plain_mean_over_micro_batches(frozen):
    # verl 0.9.1 value_loss: critic/vf_clipfrac and critic/vpred_mean are plain floats per
    # micro-batch (token means); train_mini_batch flattens them over ranks and mini-batches and
    # reduce_metrics takes their mean.
    trainer, batch = frozen
    critic = trainer.critic
    g = torch.Generator().manual_seed(5)
    vpreds = trainer.compute_values(batch)
    values = (vpreds + torch.randn(vpreds.shape, generator=g) * 0.6) * batch.response_mask
    returns = torch.randn(vpreds.shape, generator=g) * batch.response_mask
    mask = batch.response_mask.bool().tolist()
    v, old, ret = vpreds.tolist(), values.tolist(), returns.tolist()
    eps = critic.config.cliprange_value

    def clipped(r, t):
        vclip = min(max(v[r][t], old[r][t] - eps), old[r][t] + eps)
        return float((vclip - ret[r][t]) ** 2 > (v[r][t] - ret[r][t]) ** 2)

    per_token = {"critic/vf_clipfrac": clipped, "critic/vpred_mean": lambda r, t: v[r][t]}
    minis = micro_batches_of(critic, batch)
    assert [len(m) for m in minis] == [2, 1]

    metrics = critic.update_critic(batch, values, returns, step=1)

    for key, fn in per_token.items():
        flat = [x for m in token_means(minis, mask, fn) for x in m]
        expected = sum(flat) / len(flat)
        assert metrics[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key
        assert expected != pytest.approx(token_weighted(minis, mask, fn), abs=1e-3), key
