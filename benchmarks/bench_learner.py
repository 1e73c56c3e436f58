"""Learner throughput under DeepSpeed ZeRO 0-3 against a plain torch training loop.

Run: ``python benchmarks/bench_learner.py [--hidden 256] [--layers 4] [--batch 8] [--seq 128]
[--iters 5] [--stages 0,1,2,3] [--dtype float32]``

For the actor (causal LM, the learner's log-prob path) and the critic (token-classification value
model), on one rank and the same model and batch: tokens/s of forward + backward + optimizer step
(AdamW, gradient clipping at 1.0) in a plain torch loop and under each ZeRO stage, and the
DeepSpeed overhead ratio (DeepSpeed step time / plain step time). Also the seconds to gather the
actor's full weights for a push (``named_weights_for_push``, 64 MiB buckets) per stage.

The first iteration of each measurement is a warm-up and is not timed. Set ``OMP_NUM_THREADS``
before running (default 1, as every rlmesh process).
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
from rlmesh.learner.deepspeed_engine import build_engine
from rlmesh.learner.dist import init_distributed
from rlmesh.learner.forward import MicroBatch, actor_forward, critic_forward
from rlmesh.learner.models import load_actor_model, load_critic_model
from rlmesh.learner.weight_buckets import iter_weight_buckets
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
