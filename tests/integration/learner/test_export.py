"""greedy_generate equals HF greedy decoding of the same weights; exports round-trip exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.learner import PPOTrainer, build_batch, latest_checkpoint
from rlmesh.learner.checkpoints.export import main as export_main
from tests.support.learner import PAD, make_config, make_trajectories

PROMPTS = [[5, 6, 7, 8, 9], [40, 41], [70, 71, 72, 73, 74, 75, 76]]


@pytest.mark.parametrize(("stage", "lora"), [(1, False), (0, True)], ids=["zero1", "lora"])
def test_export_round_trip_and_greedy_generate(tiny_model_dir, tmp_path, stage, lora):
    extra = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.actor.optim.lr=1e-2"] if lora else []
    trainer = PPOTrainer(make_config(tiny_model_dir, *extra, stage=stage), total_training_steps=10)
    trainer.train_step(build_batch(make_trajectories(seed=10), PAD))

    out = tmp_path / "export"
    trainer.export_hf(str(out))
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).pad_token_id == PAD
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    module = trainer.actor.engine.module
    module.eval()
    with torch.no_grad():
        want = module(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if lora else 0)

    # The learner's own greedy output is HF greedy decoding of these weights.
    learner = trainer.greedy_generate(PROMPTS, max_new_tokens=12)
    eos = set(exported.generation_config.eos_token_id)
    for prompt, tokens in zip(PROMPTS, learner, strict=True):
        x = torch.tensor([prompt])
        y = exported.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
        hf = y[0, len(prompt) :].tolist()
        hf = hf[: next((i + 1 for i, t in enumerate(hf) if t in eos), len(hf))]
        assert tokens == hf
    assert any(len(t) > 1 for t in learner)

    # `rlmesh export` from a checkpoint on disk gives the same tensors.
    root = tmp_path / "ckpt"
    trainer.save_checkpoint(str(root / "global_step_1"), {"step": 1})
    assert latest_checkpoint(root) == str(root / "global_step_1")
    out2 = tmp_path / "export-cli"
    assert export_main(["--checkpoint", str(root), "--out", str(out2)]) == 0
    a, b = load_file(out / "model.safetensors"), load_file(out2 / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6 if lora else 0, msg=name)
