"""The learner tests' cases: a tiny model, configs, synthetic trajectories, and the ZeRO and
checkpoint cases that tests and the programs they start both run."""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from rlmesh.config import RLMeshConfig, load_config
from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.v1.trajectory_pb2 import Trajectory

# Metrics that differ from run to run: durations and wall-clock start times.
TIMING_PREFIXES = ("timing_s/", "timing_start/")

VOCAB = 100  # the char-level tokenizer's vocabulary (rlmesh.models.tokenizer)
PAD = 96  # <|endoftext|>: eos and pad


def tiny_model(out_dir: str | Path, seed: int = 1, hidden_size: int = 32) -> Path:
    """A 2-layer Qwen2 with hidden size 32 (~10k parameters without embeddings)."""
    return build_tiny_model(
        out_dir,
        build_tokenizer(),
        hidden_size=hidden_size,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seed=seed,
    )


def make_config(
    model_dir: str | Path, *overrides: str, estimator: str = "grpo", stage: int = 0
) -> RLMeshConfig:
    """fp32, ZeRO ``stage`` for actor and critic, 4 prompts x 2 samples, 2 mini-batches, micro 2."""
    base = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "data.train_batch_size=4",
        "data.max_prompt_length=12",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.deepspeed_config.zero_stage={stage}",
        "actor_rollout_ref.actor.deepspeed_config.dtype=float32",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"critic.deepspeed_config.zero_stage={stage}",
        "critic.deepspeed_config.dtype=float32",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "critic.optim.lr=1e-3",
        f"algorithm.adv_estimator={estimator}",
        "trainer.device=cpu",
    ]
    return load_config(None, [*base, *overrides])


def make_trajectories(
    n_prompts: int = 4, n: int = 2, seed: int = 0, with_ref: bool = True, with_rollout: bool = True
) -> list[Trajectory]:
    """Random prompts (3-10 tokens) and responses (2-8 tokens), scores in {0, 1}, log-probs near
    what a tiny random model gives (about -4.6 = log(1/100))."""
    rng = random.Random(seed)
    out = []
    for g in range(n_prompts):
        prompt = [rng.randrange(0, 95) for _ in range(rng.randint(3, 10))]
        for k in range(n):
            response = [rng.randrange(0, 95) for _ in range(rng.randint(2, 8))]
            t = Trajectory(
                uid=f"p{g}/{k}",
                group_uid=f"p{g}",
                prompt_ids=prompt,
                response_ids=response,
                score=float(rng.random() < 0.5),
                policy_version=0,
                data_source="arithmetic",
            )
            if with_rollout:
                t.rollout_log_probs.extend([-4.6 + rng.uniform(-0.1, 0.1) for _ in response])
            if with_ref:
                t.ref_log_probs.extend([-4.6 + rng.uniform(-0.1, 0.1) for _ in response])
            out.append(t)
    # Make sure every group has both a 0 and a 1 score: GRPO advantages are then non-zero.
    for g in range(n_prompts):
        out[g * n].score, out[g * n + 1].score = 1.0, 0.0
    return out


def actor_state(trainer) -> dict[str, torch.Tensor]:
    """Full actor weights, HF-named (collective under ZeRO-3)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in trainer.named_weights_for_push(bucket_bytes=1 << 20):
        out.update(bucket)
    return out


def module_state(engine) -> dict[str, torch.Tensor]:
    """Every parameter of a DeepSpeed engine's module, full (gathered under ZeRO-3; collective)."""
    import contextlib

    import deepspeed

    named = list(engine.module.named_parameters())
    gather = (
        deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None)
        if engine.zero_optimization_stage() == 3
        else contextlib.nullcontext()
    )
    with gather:
        return {name: p.detach().clone().float() for name, p in named}


# Every loss term on: GAE (critic), KL loss, entropy bonus, token-level rollout IS; 2 epochs over
# shuffled mini-batches of 4 samples, micro-batches of 1 (gradient accumulation on every rank).
ZERO_CASE = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "critic.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.shuffle=true",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "algorithm.rollout_correction.rollout_is=token",
)
ZERO_PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


def run_zero_case(model_dir: str | Path, stage: int, checkpoint_dir: str | Path | None = None) -> dict:
    """One PPO step of the ZERO_CASE config at ``stage``; metrics, full weights and greedy output.

    With ``checkpoint_dir``: also save a checkpoint there after the step, train a second step,
    load the checkpoint back and train the second step again; ``resumed`` tells whether both
    second steps gave the same metrics and weights.
    """
    from rlmesh.learner import PPOTrainer, build_batch

    cfg = make_config(model_dir, *ZERO_CASE, estimator="gae", stage=stage)
    trainer = PPOTrainer(cfg, total_training_steps=10)
    batch = build_batch(make_trajectories(seed=3), PAD)
    metrics = trainer.train_step(batch)
    result = {
        "metrics": metrics,
        "actor": actor_state(trainer),
        "critic": module_state(trainer.critic.engine),
        "greedy": trainer.greedy_generate(ZERO_PROMPTS, max_new_tokens=6),
    }
    if checkpoint_dir is not None:
        trainer.save_checkpoint(str(checkpoint_dir), {"step": 1})
        second = build_batch(make_trajectories(seed=4), PAD)
        runs = []
        for _ in range(2):
            m = trainer.train_step(second)
            runs.append(
                ({k: v for k, v in m.items() if not k.startswith(TIMING_PREFIXES)}, actor_state(trainer))
            )
            extra = trainer.load_checkpoint(str(checkpoint_dir))
        (m1, w1), (m2, w2) = runs
        result["resumed"] = extra == {"step": 1} and m1 == m2 and all(torch.equal(w1[n], w2[n]) for n in w1)
    return result


def flat_state(x, prefix: str = "") -> dict[str, object]:
    """Tensors and plain numbers of a nested optimizer/scheduler state, keyed by their path."""
    out: dict[str, object] = {}
    if isinstance(x, dict):
        for k, v in x.items():
            out.update(flat_state(v, f"{prefix}/{k}"))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            out.update(flat_state(v, f"{prefix}/{i}"))
    elif isinstance(x, torch.Tensor):
        out[prefix] = x.detach().clone()
    elif isinstance(x, (int, float, bool, str)) or x is None:
        out[prefix] = x
    return out


# Checkpoint/resume case: actor ZeRO-2 (partitioned optimizer state), critic stage 0, GAE, KL in
# the reward with the trainer's own adaptive controller, lr warmup, 2 shuffled epochs.
CKPT_CASE = (
    "actor_rollout_ref.actor.deepspeed_config.zero_stage=2",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.horizon=10",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.shuffle=true",
)


def ckpt_trainer(model_dir: str | Path):
    from rlmesh.learner import PPOTrainer

    return PPOTrainer(make_config(model_dir, *CKPT_CASE, estimator="gae"), total_training_steps=10)


def ckpt_snapshot(trainer, metrics: dict) -> dict:
    """What must be equal after resume: weights, optimizer and scheduler states, step metrics."""
    return {
        "metrics": {k: v for k, v in metrics.items() if not k.startswith(TIMING_PREFIXES)},
        "actor": module_state(trainer.actor.engine),
        "critic": module_state(trainer.critic.engine),
        "actor_optim": flat_state(trainer.actor.engine.optimizer.state_dict()),
        "critic_optim": flat_state(trainer.critic.engine.optimizer.state_dict()),
        "actor_sched": flat_state(trainer.actor.scheduler.state_dict()),
        "kl_ctrl": trainer.kl_ctrl.state_dict(),
    }


def run_uneven_case(model_dir: str | Path, stage: int) -> dict:
    """A batch of 5 samples (some trajectories dropped): mini-batches of 4 and 1 samples, so with 2
    ranks one rank runs only a dummy micro-batch in the second; dynamic micro-batches for the
    log-prob pass. Metrics and full actor weights after one step."""
    from rlmesh.learner import PPOTrainer, build_batch

    cfg = make_config(
        model_dir,
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=40",
        estimator="gae",
        stage=stage,
    )
    trainer = PPOTrainer(cfg, total_training_steps=10)
    metrics = trainer.train_step(build_batch(make_trajectories(seed=5)[:5], PAD))
    return {"metrics": metrics, "actor": actor_state(trainer)}


async def feeder_and_collector(redis, keys, items, *, batch_size: int, n: int, keep_group=None):
    """A PromptFeeder over ``items`` (in order) and a BatchCollector that wants what it feeds, as the
    learner's loop wires them, on real Redis streams."""
    from rlmesh.data import PromptCursor
    from rlmesh.learner.run.collect import BatchCollector
    from rlmesh.learner.run.feeder import PromptFeeder
    from rlmesh.queue import TrajectoryCollector, prompt_queue, trajectory_queue

    prompts = prompt_queue(redis, keys, "learner")
    await prompts.ensure_group()
    feeder = PromptFeeder(
        prompts, items, PromptCursor(len(items), shuffle=False), batch_size=batch_size, n=n, incarnation=1
    )
    learner_side = trajectory_queue(redis, keys, "learner-0")
    await learner_side.ensure_group()
    collector = BatchCollector(
        TrajectoryCollector(learner_side, keys.used_uids),
        n=n,
        incarnation=1,
        max_staleness=0,
        validate=lambda t: None,
        wanted=lambda gid: gid in feeder.outstanding,  # as the learner's loop does
        keep_group=keep_group,
    )
    return feeder, collector


@contextlib.asynccontextmanager
async def serve_rollout(servicer: Any) -> AsyncIterator[str]:
    """A real gRPC server on loopback serving ``servicer`` as the Rollout service; yields its address."""
    import grpc

    from rlmesh.v1 import rollout_pb2_grpc

    server = grpc.aio.server()
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def first_step_gradient(actor: Any, *update_args: Any) -> dict[str, torch.Tensor]:
    """The gradient the first optimizer step of ``actor.update_policy(*update_args)`` applies (its
    first mini-batch's), read as the optimizer steps; the weights, optimizer and lr schedule are
    put back after, so the next call starts from the same ones."""
    module, optimizer, scheduler = actor.engine.module, actor.engine.optimizer, actor.scheduler
    saved = copy.deepcopy((module.state_dict(), optimizer.state_dict(), scheduler.state_dict()))
    grads: dict[str, torch.Tensor] = {}

    def keep_first(*_: object) -> None:
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in module.named_parameters()})

    handle = optimizer.register_step_pre_hook(keep_first)
    try:
        actor.update_policy(*update_args)
    finally:
        handle.remove()
        module.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        scheduler.load_state_dict(saved[2])
    return grads
