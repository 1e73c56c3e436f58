"""Padding-free sequence packing (data.use_sequence_packing / use_remove_padding): every pass gives
the padded layout's log-probs, entropies, values and gradients, and no sequence sees another.

Tolerance, fp32: 1e-5 absolute on outputs; on each gradient tensor a difference of at most 1e-5 of
its norm. Packed and padded compute the same function; they differ in matrix shapes and where the
masked keys sit, i.e. in float summation order only.
"""

from __future__ import annotations

import random

import pytest
import torch

from rlmesh.config import ActorConfig, CriticConfig, load_config
from rlmesh.config.errors import ConfigError
from rlmesh.learner import PPOTrainer, build_batch
from rlmesh.learner.ppo.actor import DeepSpeedPPOActor
from rlmesh.learner.ppo.critic import DeepSpeedPPOCritic
from rlmesh.learner.ppo.forward import actor_forward, critic_forward, slice_micro_batch, token_cost_in_pairs
from rlmesh.learner.ppo.model_loading import load_actor_model, load_critic_model
from rlmesh.learner.ppo.packed_layout import packed_layout
from rlmesh.reference import ReferenceModel, compute_ref_log_probs, token_budget_micro_batches
from rlmesh.v1.trajectory_pb2 import Trajectory
from tests.support.learner import PAD, TIMING_PREFIXES, make_config, module_state


@pytest.fixture(scope="module")
def llama_model_dir(tmp_path_factory):
    from rlmesh.models import build_tiny_model, build_tokenizer

    return build_tiny_model(
        tmp_path_factory.mktemp("llama"), build_tokenizer(), arch="llama", hidden_size=32, num_layers=2,
        num_heads=4, num_kv_heads=2, seed=3,
    )  # fmt: skip


def _model_dir(request, arch):
    return request.getfixturevalue("tiny_model_dir" if arch == "qwen2" else "llama_model_dir")


def _trajectories(n_prompts=5, n=3, seed=5, long_every=4):
    """Prompts of 2-12 tokens, n samples each; responses of 1-8 tokens, every ``long_every``-th of
    30-40 (a long tail): left-padded prompts and right-padded responses of many widths."""
    rng = random.Random(seed)
    out = []
    for g in range(n_prompts):
        prompt = [rng.randrange(95) for _ in range(rng.randint(2, 12))]
        for k in range(n):
            long = (g * n + k) % long_every == long_every - 1
            response = [rng.randrange(95) for _ in range(rng.randint(30, 40) if long else rng.randint(1, 8))]
            t = Trajectory(uid=f"p{g}/{k}", group_uid=f"p{g}", prompt_ids=prompt, response_ids=response,
                           score=float(k == 0), policy_version=0, data_source="arithmetic")  # fmt: skip
            t.rollout_log_probs.extend(-4.6 + rng.uniform(-0.1, 0.1) for _ in response)
            t.ref_log_probs.extend(-4.6 + rng.uniform(-0.1, 0.1) for _ in response)
            out.append(t)
    return out


def _batch(**kwargs):
    return build_batch(_trajectories(**kwargs), PAD)


def _assert_close_in_norm(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert float((got - want).norm()) <= 1e-5 * float(want.norm()), name


def test_layout_holds_each_sequence_once_with_its_own_positions(tiny_model_dir):
    batch = _batch()
    mb = slice_micro_batch(batch, list(range(len(batch))))
    n, w = mb.responses.shape
    p = mb.input_ids.shape[1] - w
    lengths = mb.attention_mask.sum(dim=1)
    layout = packed_layout(
        mb, token_cost_in_pairs(load_actor_model(str(tiny_model_dir))), share_prompts=False
    )
    rows, width = layout.input_ids.shape
    assert width == int(lengths.max()) and rows < n  # back to back, no row past the longest sequence
    prompt_len = mb.attention_mask[:, :p].sum(dim=1)
    for r in range(n):
        g, k = int(layout.row[r]), int(lengths[r] - prompt_len[r])
        # Token j is scored by the output before it: the sequence's own last prompt token for j = 0.
        last_prompt, first = int(layout.before[r, 0]), int(layout.before[r, 1]) if k > 1 else None
        assert layout.input_ids[g, last_prompt] == mb.input_ids[r, p - 1]
        assert layout.position_ids[g, last_prompt] == prompt_len[r] - 1
        if first is not None:
            cols = torch.arange(first, first + k)
            assert torch.equal(layout.input_ids[g, cols], mb.responses[r, :k])
            assert torch.equal(layout.position_ids[g, cols], torch.arange(k) + prompt_len[r])
            assert torch.equal(layout.before[r, 1:k], cols[:-1])
            # The last response token sees exactly its own prompt and response, up to itself.
            seen = layout.attention_mask[g, 0, int(cols[-1])].nonzero().flatten()
            assert torch.equal(seen, torch.arange(last_prompt - int(prompt_len[r]) + 1, int(cols[-1]) + 1))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize(
    ("share", "long_every"),
    [(False, 4), (True, 4), (True, 10_000)],
    ids=["sequences", "prompts-shared-or-not", "prompts-shared"],
)
def test_packed_outputs_and_gradients_equal_the_padded_ones(request, arch, share, long_every):
    model_dir = _model_dir(request, arch)
    batch = _batch(long_every=long_every)
    mb = slice_micro_batch(batch, list(range(len(batch))))
    mask = batch.response_mask[:, : mb.response_width].bool()
    actor = load_actor_model(str(model_dir))
    if long_every == 10_000:  # short responses under each prompt: one unit per prompt pays
        assert packed_layout(mb, token_cost_in_pairs(actor), share_prompts=True).shared
    outputs, grads = {}, {}
    for pack in (False, True):
        actor.zero_grad()
        log_probs, entropy = actor_forward(
            actor, mb, temperature=0.7, calculate_entropy=True, share_prompts=share, pack=pack
        )
        ((log_probs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
        outputs[pack] = (log_probs.detach() * mask, entropy.detach() * mask)
        grads[pack] = {n: p.grad.clone() for n, p in actor.named_parameters()}
    torch.testing.assert_close(outputs[True], outputs[False], rtol=0, atol=1e-5)
    for name, grad in grads[False].items():
        _assert_close_in_norm(grads[True][name], grad, name)

    critic = load_critic_model(str(model_dir))
    values = {}
    for pack in (False, True):
        critic.zero_grad()
        v = critic_forward(critic, mb, share_prompts=share, pack=pack)
        (v * mask).square().sum().backward()
        values[pack] = (v.detach() * mask, {n: p.grad.clone() for n, p in critic.named_parameters()})
    torch.testing.assert_close(values[True][0], values[False][0], rtol=0, atol=1e-5)
    for name, grad in values[False][1].items():
        _assert_close_in_norm(values[True][1][name], grad, name)


def test_a_sequence_does_not_see_its_neighbours_in_the_pack(tiny_model_dir):
    actor = load_actor_model(str(tiny_model_dir)).eval()
    critic = load_critic_model(str(tiny_model_dir)).eval()
    one, other = _trajectories(seed=5), _trajectories(seed=6)  # the same long tail, other tokens
    target = one[0]
    results = []
    for neighbours in (one[1:], other[1:]):
        batch = build_batch([target, *neighbours], PAD)
        mb = slice_micro_batch(batch, list(range(len(batch))))
        layout = packed_layout(mb, token_cost_in_pairs(actor), share_prompts=False)
        assert int((layout.row == layout.row[0]).sum()) > 1  # it does share its packed row
        with torch.no_grad():
            log_probs, entropy = actor_forward(
                actor, mb, calculate_entropy=True, share_prompts=False, pack=True
            )
            values = critic_forward(critic, mb, share_prompts=False, pack=True)
        k = len(target.response_ids)
        results.append((log_probs[0, :k], entropy[0, :k], values[0, :k]))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _config(model_dir, *overrides):
    # Micro-batches by a token budget (use_dynamic_bsz), the pairing packing is made for.
    return make_config(
        model_dir,
        "actor_rollout_ref.rollout.n=3",
        "data.train_batch_size=4",
        "data.max_response_length=40",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=120",
        "critic.ppo_max_token_len_per_gpu=120",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "algorithm.use_kl_in_reward=true",
        "rlmesh.reference.colocated=true",
        *overrides,
        estimator="gae",
    )


def test_ppo_steps_packed_equal_the_padded_ones(tiny_model_dir):
    """Every pass of a step: the colocated reference, old log-probs, values, critic and actor
    updates (2 mini-batches of token-budgeted micro-batches), over 2 steps."""
    results = {}
    for packing in ("data.use_sequence_packing=true", "actor_rollout_ref.model.use_remove_padding=false"):
        trainer = PPOTrainer(_config(tiny_model_dir, packing), total_training_steps=10)
        pack = packing.startswith("data")
        assert trainer.actor.pack is pack and trainer.critic.pack is pack
        assert trainer.reference is not None and trainer.reference.model.pack is pack
        batches = [_batch(n_prompts=4, seed=seed) for seed in (21, 22)]
        passes = (trainer.reference.log_probs(batches[0]), *trainer.compute_log_prob(batches[0]))
        passes += (trainer.compute_values(batches[0]),)
        metrics = []
        for batch in batches:
            m = trainer.train_step(batch)
            metrics.append({k: v for k, v in m.items() if not k.startswith(TIMING_PREFIXES)})
        results[pack] = (
            passes,
            metrics,
            module_state(trainer.actor.engine),
            module_state(trainer.critic.engine),
        )
    (passes_pad, m_pad, actor_pad, critic_pad), (passes_packed, m_packed, actor_packed, critic_packed) = (
        results[False],
        results[True],
    )
    # ref log-probs, old log-probs, entropies, values: zero past each response in both.
    for got, want in zip(passes_packed, passes_pad, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for step_pad, step_packed in zip(m_pad, m_packed, strict=True):
        assert step_pad.keys() == step_packed.keys()
        for key, value in step_pad.items():
            assert step_packed[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # Adam moves a weight by up to lr whatever its gradient's size: bounded at a tenth of lr (1e-3).
    for want, got in ((actor_pad, actor_packed), (critic_pad, critic_packed)):
        for name, weight in want.items():
            torch.testing.assert_close(got[name], weight, rtol=0, atol=1e-4, msg=name)


def test_reference_service_packed_equals_padded(tiny_model_dir):
    ref = ReferenceModel.load(str(tiny_model_dir), device="cpu", pack=True)
    batch = _trajectories(seed=7)
    prompts = [list(t.prompt_ids) for t in batch]
    responses = [list(t.response_ids) for t in batch]
    got = {
        pack: compute_ref_log_probs(
            ref.model, prompts, responses, max_tokens_per_batch=100, temperature=0.7, pack=pack
        )
        for pack in (False, True)
    }
    for packed, padded, r in zip(got[True], got[False], responses, strict=True):
        assert len(packed) == len(r)
        assert packed == pytest.approx(padded, abs=1e-5)


def test_packed_reference_micro_batches_hold_the_budget_in_real_tokens():
    lengths = [50, 3, 40, 7, 9, 30, 2]
    batches = token_budget_micro_batches(lengths, 60, packed=True)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) == 1 or sum(lengths[i] for i in b) <= 60 for b in batches)
    assert len(batches) < len(token_budget_micro_batches(lengths, 60))  # padded: rows x longest <= 60


def test_config_keys_turn_packing_on_per_role():
    cfg = load_config(None, ["data.use_sequence_packing=true"])
    arr = cfg.actor_rollout_ref
    assert (
        arr.model.use_remove_padding and arr.actor.use_remove_padding and cfg.critic.model.use_remove_padding
    )
    # verl's defaults: the policy packs, the critic does not; the actor's key follows the model's.
    cfg = load_config(None, [])
    assert cfg.actor_rollout_ref.actor.use_remove_padding and not cfg.critic.model.use_remove_padding
    cfg = load_config(
        None, ["actor_rollout_ref.model.use_remove_padding=false", "critic.model.use_remove_padding=true"]
    )
    assert not cfg.actor_rollout_ref.actor.use_remove_padding and cfg.critic.model.use_remove_padding


@pytest.mark.parametrize(
    "key", ["actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.actor.use_remove_padding"]
)
def test_packing_everywhere_and_off_for_a_role_is_refused(key):
    with pytest.raises(ConfigError, match=rf"data.use_sequence_packing=true .* {key}=false"):
        load_config(None, ["data.use_sequence_packing=true", f"{key}=false"])


def test_a_model_that_cannot_pack_is_refused_naming_the_key(tiny_model_dir):
    actor = load_actor_model(str(tiny_model_dir))
    actor.config._attn_implementation = "eager"  # an additive float mask: not what packing builds
    common = {"rollout_n": 1, "norm_len": 8, "seed": 0, "device": torch.device("cpu")}
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.use_remove_padding=true .* 'eager'"):
        DeepSpeedPPOActor(actor, None, ActorConfig(use_remove_padding=True), temperature=1.0, **common)
    DeepSpeedPPOActor(actor, None, ActorConfig(use_remove_padding=False), temperature=1.0, **common)
    critic = load_critic_model(str(tiny_model_dir))
    critic.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match=r"critic.model.use_remove_padding=true .* 'eager'"):
        DeepSpeedPPOCritic(critic, None, CriticConfig(model={"use_remove_padding": True}), **common)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.use_remove_padding=true .* 'eager'"):
        ReferenceModel(actor, pack=True)
    mb = slice_micro_batch(_batch(), [0, 1])
    with pytest.raises(ValueError, match="sequence packing cannot run on this model"):
        actor_forward(actor, mb, pack=True)
