"""Offloaded optimizer states are stepped by DeepSpeed's CPU Adam on several threads and compute
torch's AdamW (compiling the op on first use takes one to two minutes)."""

import torch

from rlmesh.config import OptimConfig
from rlmesh.learner.ppo.deepspeed_engine import build_optimizer


def stepped(offload: bool, threads: int = 2) -> tuple[torch.optim.Optimizer, torch.Tensor, list[int]]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 33))
    optimizer = build_optimizer(
        [weight], OptimConfig(lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95]), offload=offload, threads=threads
    )
    seen: list[int] = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    for step in range(3):
        weight.grad = torch.sin(torch.arange(weight.numel(), dtype=torch.float32) + step).view_as(weight)
        optimizer.step()
    return optimizer, weight.detach().clone(), seen


def test_offloaded_states_step_with_deepspeeds_cpu_adam_as_torch_adamw_does():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cpu_adam, ours, _ = stepped(offload=True)
    assert isinstance(cpu_adam, DeepSpeedCPUAdam)
    _, torchs, _ = stepped(offload=False)
    torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-6)


def test_the_offloaded_step_runs_on_its_threads_and_gives_them_back():
    before = torch.get_num_threads()
    _, _, seen = stepped(offload=True, threads=2)
    assert seen == [2, 2, 2] and torch.get_num_threads() == before
    _, _, seen = stepped(offload=False)
    assert seen == [before] * 3  # not offloaded: the rank's own threads


def test_a_zero_engine_with_offloaded_optimizer_states_steps_them_with_cpu_adam(tmp_path):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from rlmesh.config import EngineSettings
    from rlmesh.learner.dist import init_distributed
    from rlmesh.learner.ppo.deepspeed_engine import build_engine
    from rlmesh.learner.ppo.model_loading import load_actor_model
    from tests.support.learner import tiny_model

    init_distributed()
    settings = EngineSettings(zero_stage=1, offload_param=False, offload_optimizer=True, dtype="float32")
    engine, optimizer = build_engine(
        load_actor_model(str(tiny_model(tmp_path / "model"))),
        OptimConfig(lr=1e-2),
        settings,
        1.0,
        world_size=1,
        optimizer_threads=2,
    )
    assert isinstance(optimizer, DeepSpeedCPUAdam)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    ids = torch.arange(12).view(2, 6) % engine.module.config.vocab_size
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    changed = [n for n, p in engine.module.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed and torch.isfinite(loss)
