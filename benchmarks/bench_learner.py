"""Learner throughput under DeepSpeed ZeRO 0-3 against a plain torch training loop, and the time of
each phase of a demo-shaped PPO step.

Run: ``python benchmarks/bench_learner.py [--hidden 256] [--layers 4] [--batch 8] [--seq 128]
[--iters 5] [--stages 0,1,2,3] [--dtype float32]``, or ``--ppo-step`` for the demo PPO step alone, or
``--long-tail`` for the long-tail PPO step alone (``make bench-learner`` runs all three).

For the actor (causal LM, the learner's log-prob path) and the critic (token-classification value
model), on one rank and the same model and batch: tokens/s of forward + backward + optimizer step
(AdamW, gradient clipping at 1.0) in a plain torch loop and under each ZeRO stage, and the
DeepSpeed overhead ratio (DeepSpeed step time / plain step time). Also the seconds to gather the
actor's full weights for a push (``named_weights_for_push``, 64 MiB buckets) per stage.

The first iteration of each measurement is a warm-up and is not timed. Set ``OMP_NUM_THREADS``
before running (default 1, as every rlmesh process).

PPO step (``--ppo-step [--steps 8] [--threads 1] [override ...]``): ``PPOTrainer.train_step`` with
the demo's config (``examples/cpu_demo.yaml``: 32 prompts x 4 samples, 2 mini-batches, GAE, KL in
the reward) on the demo's model shape (a random-init Qwen2, hidden 128, 2 layers, the demo's
tokenizer) and the demo's arithmetic prompts, responses of 2-12 tokens (most 5, the demo's answer
length). Three trainers from the same weights train on the same batches, step by step in turn:
``packed`` (padding-free, ``data.use_sequence_packing``: every forward, the critic's too),
``shared`` (padded, each prompt run once for all its samples, ``share_prompts``) and ``padded``
(neither). It prints the median seconds (wall and CPU) of each phase of each, padded over packed,
the real tokens per second of a whole step, and the largest difference between the metrics of
packed and padded.

Long tail (``--long-tail``): the same on batches of 16 prompts x 4 samples with a long-tailed
length distribution (prompts of 16-48 tokens; responses of 4-32 tokens, one in 16 of 256-512), in
micro-batches of at most 4096 real tokens (``use_dynamic_bsz``): where padding costs most.

Overrides are the config's (``key=value``), e.g. ``critic.model.enable_gradient_checkpointing=false``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from rlmesh.config import EngineSettings, OptimConfig
from rlmesh.learner.dist import init_distributed
from rlmesh.learner.ppo.deepspeed_engine import build_engine
from rlmesh.learner.ppo.forward import MicroBatch, actor_forward, critic_forward
from rlmesh.learner.ppo.model_loading import load_actor_model, load_critic_model
from rlmesh.learner.weight_sync.full_weights import iter_weight_buckets
from rlmesh.models import build_tiny_model, build_tokenizer


def make_micro_batch(batch: int, seq: int, vocab: int) -> MicroBatch:
    """Full sequences (no padding), the second half of each being the "response"."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    return MicroBatch(
        rows=list(range(batch)),
        input_ids=ids,
        attention_mask=mask,
        position_ids=torch.arange(seq).expand(batch, seq),
        responses=ids[:, seq // 2 :],
        width=seq - seq // 2,
    )


def actor_loss(module: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    log_probs, _ = actor_forward(module, mb)
    return -log_probs.mean()


def critic_loss(module: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    return critic_forward(module, mb).square().mean()


def time_steps(step: Callable[[], None], iters: int) -> float:
    """Seconds per step, over ``iters`` steps after one warm-up step."""
    step()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters


def plain_step_time(
    module: torch.nn.Module, loss_fn, mb: MicroBatch, iters: int, dtype: torch.dtype
) -> float:
    module.train()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-5)

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(module, mb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return time_steps(step, iters)


def deepspeed_step_time(engine, loss_fn, mb: MicroBatch, iters: int) -> float:
    engine.train()

    def step() -> None:
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(loss_fn(engine, mb), scale_wrt_gas=False)
        engine.step()

    return time_steps(step, iters)


PPO_PHASES = ("ref", "old_log_prob", "values", "adv", "update_critic", "update_actor")


def demo_batches(workdir: str, steps: int, seed: int = 0) -> tuple[str, list]:
    """The demo's model shape (random weights) under ``workdir``, and ``steps`` demo-shaped batches."""
    import random
    from pathlib import Path

    from rlmesh.data import RLHFDataset, format_arithmetic_solution, generate_arithmetic
    from rlmesh.job.demo import DEMO_WORDS
    from rlmesh.learner import build_batch
    from rlmesh.models.tokenizer import load_tokenizer
    from rlmesh.v1.trajectory_pb2 import Trajectory

    model = Path(workdir) / "model"
    build_tiny_model(model, build_tokenizer(words=DEMO_WORDS), hidden_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, seed=seed)  # fmt: skip
    data = Path(workdir) / "data"
    generate_arithmetic(data, seed, train_size=2100, val_size=200, dev_size=200, min_terms=2, max_terms=2,
                        max_operand=49, ops="+")  # fmt: skip
    tokenizer = load_tokenizer(model)
    items = RLHFDataset(str(data / "train.parquet"), tokenizer, max_prompt_length=64).items
    rng = random.Random(seed)
    vocab = len(tokenizer)
    batches = []
    for step in range(steps):
        trajectories = []
        for g in range(32):
            item = items[rng.randrange(len(items))]
            answer = tokenizer.encode(format_arithmetic_solution(item.ground_truth) + tokenizer.eos_token,
                                      add_special_tokens=False)  # fmt: skip
            for k in range(4):
                if rng.random() < 0.8:  # the answer's shape, right or wrong
                    response = answer[:1] + [rng.randrange(vocab) for _ in answer[1:-1]] + answer[-1:]
                else:  # a sampled ramble, up to the demo's max_response_length
                    response = [rng.randrange(vocab) for _ in range(rng.randint(2, 12))]
                t = Trajectory(uid=f"{step}/{g}/{k}", group_uid=f"{step}/{g}", prompt_ids=item.prompt_ids,
                               response_ids=response, score=float(rng.random() < 0.3), policy_version=step,
                               data_source="arithmetic")  # fmt: skip
                t.rollout_log_probs.extend(-rng.uniform(0.0, 3.0) for _ in response)
                t.ref_log_probs.extend(-rng.uniform(0.0, 3.0) for _ in response)
                trajectories.append(t)
        batches.append(build_batch(trajectories, tokenizer.pad_token_id, with_ref=True))
    return str(model), batches


def long_tail_batches(model: str, steps: int, seed: int = 0, prompts: int = 16, n: int = 4) -> list:
    """``steps`` batches of ``prompts`` x ``n`` random sequences with a long tail: prompts of 16-48
    tokens; responses of 4-32 tokens, except one in 16 of 256-512."""
    import random

    from rlmesh.learner import build_batch
    from rlmesh.models.tokenizer import load_tokenizer
    from rlmesh.v1.trajectory_pb2 import Trajectory

    tokenizer = load_tokenizer(model)
    vocab = len(tokenizer)
    rng = random.Random(seed)
    batches = []
    for step in range(steps):
        trajectories = []
        for g in range(prompts):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(16, 48))]
            for k in range(n):
                length = rng.randint(256, 512) if rng.random() < 1 / 16 else rng.randint(4, 32)
                response = [rng.randrange(vocab) for _ in range(length)]
                t = Trajectory(uid=f"{step}/{g}/{k}", group_uid=f"{step}/{g}", prompt_ids=prompt,
                               response_ids=response, score=float(rng.random() < 0.3), policy_version=step,
                               data_source="arithmetic")  # fmt: skip
                t.rollout_log_probs.extend(-rng.uniform(0.0, 3.0) for _ in response)
                t.ref_log_probs.extend(-rng.uniform(0.0, 3.0) for _ in response)
                trajectories.append(t)
        batches.append(build_batch(trajectories, tokenizer.pad_token_id, with_ref=True))
    return batches


# name: (config overrides, share_prompts). "packed" is the default config (use_remove_padding) with
# the critic packed too; "shared" runs each prompt once for its samples, padded; "padded" neither.
VARIANTS: dict[str, tuple[list[str], bool]] = {
    "packed": (["data.use_sequence_packing=true"], True),
    "shared": (["actor_rollout_ref.model.use_remove_padding=false"], True),
    "padded": (["actor_rollout_ref.model.use_remove_padding=false"], False),
}

# The long-tail batch: 16 prompts x 4 samples, 2 mini-batches, micro-batches by a token budget.
LONG_TAIL_OVERRIDES = [
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "data.max_response_length=512",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
]


def ppo_step(steps: int, threads: int, overrides: list[str], long_tail: bool = False) -> None:
    """Per-phase times of the demo's PPO step in each of :data:`VARIANTS`, in turn; see the module
    doc. ``long_tail``: on :func:`long_tail_batches` (with :data:`LONG_TAIL_OVERRIDES`)."""
    import statistics
    from pathlib import Path

    from rlmesh.config import load_config
    from rlmesh.learner import PPOTrainer

    torch.set_num_threads(threads)
    warmup = 2
    with tempfile.TemporaryDirectory() as tmp:
        model, batches = demo_batches(tmp, warmup + steps)
        if long_tail:
            batches = long_tail_batches(model, warmup + steps)
            overrides = [*LONG_TAIL_OVERRIDES, *overrides]
        demo_yaml = Path(__file__).resolve().parents[1] / "examples" / "cpu_demo.yaml"
        trainers = {}
        for name, (variant, share) in VARIANTS.items():
            cfg = load_config(demo_yaml, [f"actor_rollout_ref.model.path={model}", *overrides, *variant])
            trainer = PPOTrainer(cfg, total_training_steps=280)
            trainer.actor.share_prompts = share
            if trainer.critic is not None:
                trainer.critic.share_prompts = share
            trainers[name] = trainer
        names = list(VARIANTS)
        wall = {name: {k: [] for k in (*PPO_PHASES, "step")} for name in names}
        cpu = {name: [] for name in names}
        worst: dict[str, tuple[float, float, float]] = {}  # metric: (relative difference, padded, packed)
        tokens = [int(b.attention_mask.sum()) for b in batches]
        lengths = torch.cat([b.attention_mask.sum(dim=1) for b in batches]).float()
        print(
            f"PPO step: demo config{' + long tail' if long_tail else ''}, {len(batches[0])} sequences of "
            f"{lengths.mean():.1f} tokens on average (median {lengths.median():.0f}, max {lengths.max():.0f}; "
            f"padded to {batches[0].input_ids.shape[1]}); torch threads {threads}; {steps} steps after "
            f"{warmup} warm-up; overrides {overrides or 'none'}",
            flush=True,
        )
        for i, batch in enumerate(batches):
            metrics = {}
            for name in names[i % len(names) :] + names[: i % len(names)]:  # each goes first in turn
                c0, t0 = time.process_time(), time.perf_counter()
                metrics[name] = trainers[name].train_step(batch)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if i >= warmup:
                    for k in PPO_PHASES:
                        wall[name][k].append(metrics[name].get(f"timing_s/{k}", 0.0))
                    wall[name]["step"].append(dt)
                    cpu[name].append(dc)
            for k, v in metrics["padded"].items():
                if not k.startswith("timing"):
                    d = abs(metrics["packed"][k] - v) / max(abs(v), 1e-3)
                    if d >= worst.get(k, (-1.0,))[0]:
                        worst[k] = (d, v, metrics["packed"][k])
        print(f"{'phase (median s)':<18}" + "".join(f"{n:>10}" for n in names) + f"{'padded/packed':>15}")
        for k in (*PPO_PHASES, "step"):
            med = {n: statistics.median(wall[n][k]) for n in names}
            ratio = med["padded"] / med["packed"] if med["packed"] else float("nan")
            print(f"{k:<18}" + "".join(f"{med[n]:>10.3f}" for n in names) + f"{ratio:>15.2f}")
        med = {n: statistics.median(cpu[n]) for n in names}
        print(
            f"{'step (CPU s)':<18}"
            + "".join(f"{med[n]:>10.3f}" for n in names)
            + f"{med['padded'] / med['packed']:>15.2f}"
        )
        per_step = statistics.mean(tokens[warmup:])
        med = {n: statistics.median(wall[n]["step"]) for n in names}
        print(
            f"{'tokens/s (step)':<18}" + "".join(f"{per_step / med[n]:>10,.0f}" for n in names)
            + f"{med['padded'] / med['packed']:>15.2f}",
            flush=True,
        )  # fmt: skip
        key = max(worst, key=lambda k: worst[k][0])
        d, v, w = worst[key]
        print(
            f"largest metric difference, packed vs padded: {d:.1e} of max(|value|, 1e-3) ({key}: {v:.6g} vs {w:.6g})",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--ppo-step", action="store_true", help="only the demo-shaped PPO step")
    parser.add_argument(
        "--long-tail", action="store_true", help="only the PPO step on long-tail batches, padded vs packed"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed PPO steps (--ppo-step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the PPO step")
    parser.add_argument("overrides", nargs="*", help="config overrides of the PPO step (key=value)")
    args = parser.parse_args(argv)
    if args.ppo_step or args.long_tail:
        init_distributed()
        ppo_step(args.steps, args.threads, args.overrides, long_tail=args.long_tail)
        return 0
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    stages = [int(s) for s in args.stages.split(",")]

    init_distributed()
    tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(
            build_tiny_model(tmp, tokenizer, hidden_size=args.hidden, num_layers=args.layers, num_heads=4)
        )
        mb = make_micro_batch(args.batch, args.seq, len(tokenizer))
        tokens = args.batch * args.seq
        n_params = sum(p.numel() for p in load_actor_model(path).parameters())
        print(
            f"model: hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.2f}M params; "
            f"batch {args.batch} x {args.seq} tokens; {args.dtype}; OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}",
            flush=True,
        )
        rows = []
        for role, load, loss_fn in (
            ("actor", lambda: load_actor_model(path), actor_loss),
            ("critic", lambda: load_critic_model(path), critic_loss),
        ):
            plain = plain_step_time(load(), loss_fn, mb, args.iters, dtype)
            print(f"{role} plain torch: {plain:.3f} s/step, {tokens / plain:,.0f} tokens/s", flush=True)
            for stage in stages:
                settings = EngineSettings(
                    zero_stage=stage, offload_param=False, offload_optimizer=False, dtype=args.dtype
                )
                engine, _ = build_engine(load(), OptimConfig(lr=1e-5), settings, grad_clip=1.0, world_size=1)
                seconds = deepspeed_step_time(engine, loss_fn, mb, args.iters)
                push = ""
                if role == "actor":
                    start = time.perf_counter()
                    for _ in iter_weight_buckets(engine.module, 64 << 20, zero3=stage == 3, materialize=True):
                        pass
                    push = f", weight gather for a push {time.perf_counter() - start:.3f} s"
                print(
                    f"{role} ZeRO-{stage}: {seconds:.3f} s/step, {tokens / seconds:,.0f} tokens/s, "
                    f"overhead x{seconds / plain:.2f}{push}",
                    flush=True,
                )
                rows.append((role, stage, tokens / plain, tokens / seconds, seconds / plain))
                del engine
        print("\nrole    stage  plain tok/s  deepspeed tok/s  overhead")
        for role, stage, plain_tps, ds_tps, ratio in rows:
            print(f"{role:<7} {stage:>5}  {plain_tps:>11,.0f}  {ds_tps:>15,.0f}  x{ratio:.2f}")
    print()
    ppo_step(args.steps, args.threads, args.overrides)
    print()
    ppo_step(args.steps, args.threads, args.overrides, long_tail=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
