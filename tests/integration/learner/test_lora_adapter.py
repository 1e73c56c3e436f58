"""actor_rollout_ref.model.lora_adapter_path: LoRA training starts from a pretrained PEFT adapter,
the reference stays the base model, and an engine pushed the learner's weights generates with
base + adapter."""

from __future__ import annotations

import asyncio
import json
import warnings

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlmesh.engine.client import EngineClient
from rlmesh.learner import PPOTrainer
from rlmesh.learner.ppo.model_loading import load_actor_model
from rlmesh.learner.weight_sync.push import WeightPusher
from rlmesh.runtime.launcher import ProcessLauncher
from tests.support.learner import actor_state, make_config

ADAPTER_RANK, ADAPTER_ALPHA = 4, 8
TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPTS = [[10, 20, 30, 40], [5, 6, 7], [80, 81, 82]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    """A rank-4 adapter on three projections with random (non-zero) A and B, saved by peft."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft asks transformers 5 for is_gradient_checkpointing, which warns of its rename.
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(3)
        config = LoraConfig(
            r=ADAPTER_RANK, lora_alpha=ADAPTER_ALPHA, target_modules=TARGETS, init_lora_weights=False
        )
        model = get_peft_model(base, config)
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(str(out))
    return out


def base_plus_adapter(model_dir, adapter_dir) -> dict[str, torch.Tensor]:
    """LoRA's definition from the saved files: W + (alpha / r) B A on every adapted weight."""
    weights = {
        n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()
    }
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    adapted = 0
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[name] = weights[name] + scale * (b @ a)
        adapted += 1
    assert adapted == 2 * len(TARGETS)  # two layers
    return weights


def model_with(model_dir, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    return model


def logits(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(input_ids=ids).logits


def greedy(model: torch.nn.Module) -> list[list[int]]:
    """Greedy decoding by full forward passes: what a correct engine must reproduce."""
    outs = []
    for p in PROMPTS:
        ids = list(p)
        for _ in range(NEW_TOKENS):
            ids.append(int(logits(model, torch.tensor([ids]))[0, -1].argmax()))
        outs.append(ids[len(p) :])
    return outs


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, adapter_dir):
    cfg = make_config(
        tiny_model_dir,
        # The adapter's own rank and alpha count, as in verl: these differ on purpose.
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=32",
        f"actor_rollout_ref.model.lora_adapter_path={adapter_dir}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "rlmesh.reference.colocated=true",
    )
    return PPOTrainer(cfg, total_training_steps=10)


def test_the_actor_starts_from_base_plus_adapter_and_the_reference_is_the_base(
    trainer, tiny_model_dir, adapter_dir
):
    expected = base_plus_adapter(tiny_model_dir, adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    actor = trainer.actor.engine.module
    lora_a = [p for n, p in actor.named_parameters() if ".lora_A." in n]
    assert lora_a and all(p.shape[0] == ADAPTER_RANK and p.requires_grad for p in lora_a)
    assert all(".lora_" in n for n, p in actor.named_parameters() if p.requires_grad)

    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    want = logits(model_with(tiny_model_dir, expected), ids)
    assert torch.allclose(logits(actor.eval(), ids), want, atol=1e-5)
    assert not torch.allclose(want, logits(base, ids), atol=1e-3)  # the adapter changes the policy
    assert torch.allclose(logits(trainer.reference.model.model, ids), logits(base, ids), atol=1e-6)

    pushed = actor_state(trainer)  # what a push or an export sends: HF names, LoRA merged
    assert list(pushed) == [n for n, _ in base.named_parameters()]
    for name, tensor in pushed.items():
        assert torch.allclose(tensor, expected[name], atol=1e-6), name


def test_an_engine_pushed_the_learners_weights_generates_with_base_plus_adapter(
    trainer, tiny_model_dir, adapter_dir, tmp_path
):
    want = greedy(model_with(tiny_model_dir, base_plus_adapter(tiny_model_dir, adapter_dir)))
    base = greedy(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval())
    assert want != base, "the adapter must change the greedy output for this test to mean anything"
    with ProcessLauncher(tmp_path, stop_grace_s=20) as launcher:
        engine = launcher.start_engine(tiny_model_dir, name="lora-adapter")  # starts from model.path

        def engine_greedy() -> list[list[int]]:
            body = {
                "input_ids": PROMPTS,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            }
            return [
                o["output_ids"] for o in httpx.post(engine.url + "/generate", json=body, timeout=120).json()
            ]

        assert engine_greedy() == base

        async def push():
            client = EngineClient(engine.url, timeout_s=120)
            pusher = WeightPusher([client], backend="gloo", timeout_s=60, bucket_bytes=64 << 10)
            try:
                return await pusher.push_buckets(trainer.named_weights_for_push(bucket_bytes=64 << 10), 1)
            finally:
                await pusher.close()
                await client.aclose()

        report = asyncio.run(push())
        assert not report.failed and len(report.engines) == 1
        assert engine_greedy() == want
        assert httpx.get(engine.url + "/get_model_info").json()["weight_version"] == "1"


def test_a_missing_or_unfit_adapter_fails_naming_the_key_and_the_path(tiny_model_dir, adapter_dir, tmp_path):
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(
        ValueError, match=r"actor_rollout_ref\.model\.lora_adapter_path.*no-such-adapter.*adapter_config"
    ):
        load_actor_model(str(tiny_model_dir), lora_rank=4, lora_adapter_path=str(missing))

    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    with pytest.raises(
        ValueError, match=r"actor_rollout_ref\.model\.lora_adapter_path.*config-only.*does not load"
    ):
        load_actor_model(str(tiny_model_dir), lora_rank=4, lora_adapter_path=str(no_weights))

    other_targets = tmp_path / "other-targets"
    other_targets.mkdir()
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (other_targets / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["wq", "wv"]}))
    with pytest.raises(
        ValueError, match=r"actor_rollout_ref\.model\.lora_adapter_path.*other-targets.*does not load"
    ):
        load_actor_model(str(tiny_model_dir), lora_rank=4, lora_adapter_path=str(other_targets))


def test_an_adapter_alone_turns_lora_on(tiny_model_dir, adapter_dir):
    """verl's own example sets lora_adapter_path and no lora_rank (its 0.7 workers: LoRA on for it)."""
    cfg = make_config(tiny_model_dir, f"actor_rollout_ref.model.lora_adapter_path={adapter_dir}")
    model = cfg.actor_rollout_ref.model
    assert model.lora_rank == 0
    actor = load_actor_model(model.path, lora_rank=model.lora_rank, lora_adapter_path=model.lora_adapter_path)
    lora_a = [p for n, p in actor.named_parameters() if ".lora_A." in n]
    assert len(lora_a) == 2 * len(TARGETS) and all(p.shape[0] == ADAPTER_RANK for p in lora_a)
