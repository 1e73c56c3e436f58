"""Samples of one prompt run it once (rlmesh.learner.ppo.forward.shared_prompt_layout): log-probs,
entropies, values, gradients and whole PPO steps equal those of the padded layout.

Tolerance, fp32: 1e-5 absolute on log-probs/entropies/values; on each gradient tensor a difference
of at most 1e-5 of its norm. The two layouts compute the same function; they differ only in matrix
shapes and in where the masked keys sit, i.e. in float summation order.
"""

from __future__ import annotations

import pytest
import torch

from rlmesh.learner import PPOTrainer, build_batch
from rlmesh.learner.ppo.forward import (
    actor_forward,
    critic_forward,
    shared_prompt_layout,
    slice_micro_batch,
    token_cost_in_pairs,
)
from rlmesh.learner.ppo.model_loading import load_actor_model, load_critic_model
from tests.support.learner import (
    PAD,
    TIMING_PREFIXES,
    make_config,
    make_trajectories,
    module_state,
)


@pytest.fixture(scope="module")
def llama_model_dir(tmp_path_factory):
    from rlmesh.models import build_tiny_model, build_tokenizer

    return build_tiny_model(
        tmp_path_factory.mktemp("llama"), build_tokenizer(), arch="llama", hidden_size=32, num_layers=2,
        num_heads=4, num_kv_heads=2, seed=3,
    )  # fmt: skip


def _uneven_batch():
    """Groups of 3 samples with one sample dropped, rows of a group not adjacent."""
    trajectories = make_trajectories(n_prompts=4, n=3, seed=11)
    del trajectories[4]
    batch = build_batch(trajectories, PAD)
    order = list(range(len(batch)))
    order = order[::2] + order[1::2]  # interleave the groups
    return batch.select(order)


def _assert_close_in_norm(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert float((got - want).norm()) <= 1e-5 * float(want.norm()), name


def _model_dir(request, arch):
    return request.getfixturevalue("tiny_model_dir" if arch == "qwen2" else "llama_model_dir")


def test_layout_places_each_response_after_its_prompt():
    batch = _uneven_batch()
    mb = slice_micro_batch(batch, list(range(len(batch))))
    layout = shared_prompt_layout(mb, token_cost=1000.0)
    assert layout is not None
    n, w = mb.responses.shape
    p = layout.prompt_width
    assert layout.input_ids.shape[0] == len(set(batch.index.tolist())) == 4
    lengths = mb.attention_mask[:, p:].sum(dim=1)
    per_group = torch.zeros(4, dtype=torch.long).index_add_(0, layout.group, lengths)
    # Responses back to back without their padding: as wide as the longest prompt + responses.
    assert layout.input_ids.shape[1] == p + int(per_group.max()) < p + 3 * w
    for r in range(n):
        g, k = int(layout.group[r]), int(lengths[r])
        assert torch.equal(layout.input_ids[g, :p], mb.input_ids[r, :p])
        assert torch.equal(layout.position_ids[g, :p], mb.position_ids[r, :p])
        cols = layout.columns[r, :k]
        assert (layout.columns[r, k:] == -1).all()
        assert torch.equal(layout.input_ids[g, cols], mb.responses[r, :k])
        assert torch.equal(layout.position_ids[g, cols], mb.position_ids[r, p : p + k])
        # The token j is scored by the output just before it: the last prompt column for j = 0.
        assert torch.equal(layout.before[r, :k], torch.cat([torch.tensor([p - 1]), cols[:-1]]))
        # What the last response token attends to: its prompt's real tokens, then its own response
        # up to itself; never another sample's response.
        seen = layout.attention_mask[g, 0, int(cols[-1])].nonzero().flatten()
        prompt_cols = mb.attention_mask[r, :p].nonzero().flatten()
        assert torch.equal(seen, torch.cat([prompt_cols, cols]))


def test_layout_is_not_used_where_it_does_not_pay():
    batch = _uneven_batch()
    one_each = [batch.index.tolist().index(g) for g in ("p0", "p1", "p2", "p3")]
    assert shared_prompt_layout(slice_micro_batch(batch, one_each), token_cost=1000.0) is None  # none shared
    shared = slice_micro_batch(batch, list(range(len(batch))))
    assert shared_prompt_layout(shared, token_cost=None) is None  # the model cannot
    # Attention dominates (a per-token cost of one pair): one long packed row costs more.
    assert shared_prompt_layout(shared, token_cost=1.0) is None


def test_token_cost_refuses_models_that_cannot_take_the_mask(tiny_model_dir):
    model = load_actor_model(str(tiny_model_dir))
    assert token_cost_in_pairs(model) > 1.0
    model.config._attn_implementation = "eager"  # an additive float mask; not built here
    assert token_cost_in_pairs(model) is None
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["full_attention", "sliding_attention"]
    assert token_cost_in_pairs(model) is None


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_shared_prompts_give_the_padded_outputs_and_gradients(request, arch):
    model_dir = _model_dir(request, arch)
    batch = _uneven_batch()
    rows = list(range(len(batch)))
    mb = slice_micro_batch(batch, rows)
    mask = batch.response_mask[:, : mb.response_width].bool()
    actor = load_actor_model(str(model_dir))
    assert shared_prompt_layout(mb, token_cost_in_pairs(actor)) is not None
    outputs, grads = {}, {}
    for share in (False, True):
        actor.zero_grad()
        log_probs, entropy = actor_forward(
            actor, mb, temperature=0.7, calculate_entropy=True, share_prompts=share
        )
        ((log_probs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
        outputs[share] = (log_probs.detach() * mask, entropy.detach() * mask)
        grads[share] = {n: p.grad.clone() for n, p in actor.named_parameters()}
    torch.testing.assert_close(outputs[True], outputs[False], rtol=0, atol=1e-5)
    for name, grad in grads[False].items():
        _assert_close_in_norm(grads[True][name], grad, name)

    critic = load_critic_model(str(model_dir))
    values = {}
    for share in (False, True):
        critic.zero_grad()
        v = critic_forward(critic, mb, share_prompts=share)
        (v * mask).square().sum().backward()
        values[share] = (v.detach() * mask, {n: p.grad.clone() for n, p in critic.named_parameters()})
    torch.testing.assert_close(values[True][0], values[False][0], rtol=0, atol=1e-5)
    for name, grad in values[False][1].items():
        _assert_close_in_norm(values[True][1][name], grad, name)


def test_ppo_steps_with_shared_prompts_equal_the_padded_ones(tiny_model_dir):
    # The demo's terms: GAE (critic), KL in the reward; plus an entropy bonus; 2 mini-batches, 2 steps.
    overrides = (
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "algorithm.use_kl_in_reward=true",
    )
    results = {}
    for share in (False, True):
        trainer = PPOTrainer(
            make_config(tiny_model_dir, *overrides, estimator="gae"), total_training_steps=10
        )
        trainer.actor.share_prompts = trainer.critic.share_prompts = share
        metrics = []
        for seed in (21, 22):
            m = trainer.train_step(build_batch(make_trajectories(n_prompts=4, n=4, seed=seed), PAD))
            metrics.append({k: v for k, v in m.items() if not k.startswith(TIMING_PREFIXES)})
        results[share] = (metrics, module_state(trainer.actor.engine), module_state(trainer.critic.engine))
    (m_pad, actor_pad, critic_pad), (m_shared, actor_shared, critic_shared) = results[False], results[True]
    for step_pad, step_shared in zip(m_pad, m_shared, strict=True):
        assert step_pad.keys() == step_shared.keys()
        for key, value in step_pad.items():
            assert step_shared[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # Adam moves a weight by up to lr whatever its gradient's size, so a rounding-level change of a
    # near-zero gradient can move it by a share of lr (1e-3): bounded at a tenth of it.
    for want, got in ((actor_pad, actor_shared), (critic_pad, critic_shared)):
        for name, weight in want.items():
            torch.testing.assert_close(got[name], weight, rtol=0, atol=1e-4, msg=name)
