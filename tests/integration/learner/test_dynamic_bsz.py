"""use_dynamic_bsz (micro-batches packed by tokens) gives the gradient of fixed micro-batches.

Tolerance: 1e-5 relative / 1e-7 absolute on every gradient element (fp32): the two differ only in
how the mini-batch is cut, i.e. in float summation order and in per-micro-batch padding widths.
"""

from __future__ import annotations

import torch

from rlmesh.learner import PPOTrainer, build_batch
from rlmesh.learner.ppo.partition import plan_micro_batches
from tests.support.learner import PAD, first_step_gradient, make_config, make_trajectories, module_state


def _mini_batch_gradient(trainer: PPOTrainer, batch) -> dict[str, torch.Tensor]:
    """The gradient of the whole batch as one mini-batch. Two epochs, so the first is off-policy:
    the ratio is taken against the old log-probs given."""
    actor, config = trainer.actor, trainer.actor.config
    old_log_probs, _ = trainer.compute_log_prob(batch)
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    one_mini_batch = len(batch) // actor.rollout_n
    actor.config = config.model_copy(update={"ppo_mini_batch_size": one_mini_batch, "ppo_epochs": 2})
    try:
        return first_step_gradient(actor, batch, old_log_probs, advantages, None, 1)
    finally:
        actor.config = config


def test_dynamic_bsz_gradient_equals_fixed_micro_batches(tiny_model_dir):
    batch = build_batch(make_trajectories(n_prompts=4, n=2, seed=8), PAD)
    lengths = batch.attention_mask.sum(dim=1)
    budget = int(lengths.max()) + 4  # several micro-batches of uneven row counts
    no_clip = "actor_rollout_ref.actor.grad_clip=0"  # the optimizer sees the accumulated gradient itself
    fixed = PPOTrainer(make_config(tiny_model_dir, "actor_rollout_ref.actor.use_kl_loss=true",
                                   "actor_rollout_ref.actor.entropy_coeff=0.01", no_clip), total_training_steps=10)  # fmt: skip
    dynamic = PPOTrainer(
        make_config(
            tiny_model_dir,
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
            "data.max_prompt_length=4",  # the config check wants one whole sequence to fit the budget
            "data.max_response_length=4",
            no_clip,
        ),
        total_training_steps=10,
    )
    plan = plan_micro_batches(range(len(batch)), 1, 0, micro_batch_size=None, use_dynamic_bsz=True,
                              max_token_len=budget, seq_lens=lengths.tolist())  # fmt: skip
    assert len(plan) > 2 and len({len(p) for p in plan}) > 1, plan
    want = _mini_batch_gradient(fixed, batch)
    got = _mini_batch_gradient(dynamic, batch)
    assert sum(float(g.abs().sum()) for g in want.values()) > 0
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)

    # And the whole step: same metrics and weights.
    m_fixed = fixed.train_step(batch)
    m_dynamic = dynamic.train_step(batch)
    assert abs(m_fixed["actor/pg_loss"] - m_dynamic["actor/pg_loss"]) < 1e-6
    w_fixed, w_dynamic = module_state(fixed.actor.engine), module_state(dynamic.actor.engine)
    for name, w in w_fixed.items():
        torch.testing.assert_close(w_dynamic[name], w, rtol=0, atol=1e-6, msg=name)
