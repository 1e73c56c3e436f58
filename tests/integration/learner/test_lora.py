"""LoRA actor: only adapter weights train; pushed weights are the merged model under HF names."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from rlmesh.learner import PPOTrainer, build_batch
from tests.support.learner import PAD, actor_state, make_config, make_trajectories, module_state


def test_lora_trains_only_adapters_and_pushes_merged_weights(tiny_model_dir):
    cfg = make_config(
        tiny_model_dir,
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.optim.lr=1e-2",
    )
    trainer = PPOTrainer(cfg, total_training_steps=10)
    before = module_state(trainer.actor.engine)
    assert any(".lora_A." in n for n in before)
    trainer.train_step(build_batch(make_trajectories(seed=9), PAD))
    after = module_state(trainer.actor.engine)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed, "nothing trained"
    assert all(".lora_" in n for n in changed), sorted(changed - {n for n in changed if ".lora_" in n})
    assert any(".lora_B." in n for n in changed)  # B starts at zero: it moved, so the merge is not a no-op

    pushed = actor_state(trainer)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert list(pushed) == [n for n, _ in plain.named_parameters()]  # the names an engine loaded
    merged = copy.deepcopy(trainer.actor.engine.module).merge_and_unload()
    merged_params = dict(merged.named_parameters())
    differs_from_base = 0
    for name, tensor in pushed.items():
        assert torch.equal(tensor, merged_params[name].detach()), name
        differs_from_base += not torch.equal(tensor, dict(plain.named_parameters())[name].detach())
    assert differs_from_base > 0
