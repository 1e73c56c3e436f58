"""build_engine's shortcuts change no bit: on one rank a stage-0 fp32 engine skips its gradient
all-reduce, and AdamW runs its multi-tensor (foreach) implementation. Three optimizer steps with
gradient clipping, two micro-batches each, give the same weights and optimizer state, bit for bit,
as DeepSpeed's all-reduce and torch's per-tensor loop."""

from __future__ import annotations

import torch

from rlmesh.config import EngineSettings, OptimConfig
from rlmesh.learner.dist import init_distributed
from rlmesh.learner.ppo.deepspeed_engine import build_engine
from rlmesh.learner.ppo.model_loading import load_actor_model

SETTINGS = EngineSettings(zero_stage=0, offload_param=False, offload_optimizer=False, dtype="float32")


def _train(model_dir, *, shortcuts: bool) -> tuple[dict[str, torch.Tensor], dict]:
    init_distributed()
    engine, optimizer = build_engine(
        load_actor_model(str(model_dir)), OptimConfig(lr=1e-2, weight_decay=0.01), SETTINGS, 0.5, world_size=1
    )
    if not shortcuts:
        engine.enable_backward_allreduce = True
        for group in optimizer.param_groups:
            group["foreach"] = False
    else:
        assert engine.enable_backward_allreduce is False
        assert all(group["foreach"] for group in optimizer.param_groups)
    gen = torch.Generator().manual_seed(0)
    engine.train()
    for _ in range(3):
        for micro in range(2):
            ids = torch.randint(0, 90, (3, 9), generator=gen)
            engine.set_gradient_accumulation_boundary(micro == 1)
            loss = engine(input_ids=ids, labels=ids).loss * 10.0  # large enough to be clipped
            engine.backward(loss, scale_wrt_gas=False)
        engine.step()
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return weights, optimizer.state_dict()["state"]


def test_one_rank_shortcuts_change_no_bit(tiny_model_dir):
    want_w, want_state = _train(tiny_model_dir, shortcuts=False)
    got_w, got_state = _train(tiny_model_dir, shortcuts=True)
    for name, weight in want_w.items():
        assert torch.equal(got_w[name], weight), name
    for i, state in want_state.items():
        for key, value in state.items():
            assert torch.equal(got_state[i][key], value), (i, key)
