"""make bench-score: reward samples/s and reference tokens/s at batch 1, 16 and 64.

Starts a reward service (the built-in rule rewards) and a reference service (a tiny random Qwen2 built
on the spot, fp32 on CPU) as real processes on loopback, and calls each through its client for a
fixed time per batch size, one call after another. Reward samples are GSM8K-style responses of about
400 characters; reference samples are ``--prompt-len`` prompt + ``--response-len`` response tokens,
and tokens/s counts both. The reward core (``RewardScorer``, no gRPC) is measured in-process too, to
show what the wire costs.

Run: ``python benchmarks/bench_score.py [--seconds 3] [--hidden-size 256] [--layers 4]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from rlmesh.job.stack import start_stack
from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.reference import ReferenceClient
from rlmesh.reward.client import RewardClient
from rlmesh.reward.scorer import RewardScorer
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import reference_pb2, reward_pb2

BATCH_SIZES = (1, 16, 64)


def reward_batch(size: int, rng: random.Random) -> list[reward_pb2.RewardSample]:
    samples = []
    for i in range(size):
        answer = rng.randint(1, 10_000)
        text = (
            "Let me work through this step by step. " * 10
            + f"#### {answer if rng.random() < 0.5 else answer + 1}"
        )
        samples.append(
            reward_pb2.RewardSample(
                uid=f"s{i}", response_text=text, ground_truth=str(answer), data_source="openai/gsm8k"
            )
        )
    return samples


def reference_batch(
    size: int, prompt_len: int, response_len: int, rng: random.Random
) -> list[reference_pb2.LogProbsSample]:
    return [
        reference_pb2.LogProbsSample(
            uid=f"s{i}",
            prompt_ids=[rng.randrange(96) for _ in range(prompt_len)],
            response_ids=[rng.randrange(96) for _ in range(response_len)],
        )
        for i in range(size)
    ]


async def timed(call, seconds: float) -> tuple[int, list[float]]:
    """Calls ``call`` back to back for ``seconds`` (after one warm-up call): (calls, latencies)."""
    await call()
    latencies: list[float] = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        await call()
        latencies.append(time.perf_counter() - t0)
    return len(latencies), latencies


def summary(latencies: list[float]) -> tuple[float, float]:
    return statistics.median(latencies) * 1e3, sum(latencies)


async def bench(reward_address: str, reference_address: str, args: argparse.Namespace) -> list[tuple]:
    rng = random.Random(0)
    rows = []
    scorer = RewardScorer()
    async with (
        RewardClient([reward_address], timeout_s=60) as reward,
        ReferenceClient([reference_address], timeout_s=600) as reference,
    ):
        for size in BATCH_SIZES:
            batch = reward_batch(size, rng)

            async def core(batch=batch):
                await scorer.score(batch)

            calls, lat = await timed(core, args.seconds)
            p50, total = summary(lat)
            rows.append(("reward (in-process core)", size, calls * size / total, "samples/s", p50))
            print(f"  reward core      batch {size:>3}: {calls * size / total:>10.0f} samples/s", flush=True)

            async def over_grpc(batch=batch):
                results = await reward.score(batch)
                assert len(results) == len(batch) and not any(r.HasField("error") for r in results)

            calls, lat = await timed(over_grpc, args.seconds)
            p50, total = summary(lat)
            rows.append(("reward (gRPC)", size, calls * size / total, "samples/s", p50))
            print(f"  reward gRPC      batch {size:>3}: {calls * size / total:>10.0f} samples/s", flush=True)

        for size in BATCH_SIZES:
            batch = reference_batch(size, args.prompt_len, args.response_len, rng)
            tokens = size * (args.prompt_len + args.response_len)

            async def ref_call(batch=batch):
                results = await reference.log_probs(batch)
                assert len(results) == len(batch)

            calls, lat = await timed(ref_call, args.seconds)
            p50, total = summary(lat)
            rows.append(("reference (gRPC)", size, calls * tokens / total, "tokens/s", p50))
            print(f"  reference gRPC   batch {size:>3}: {calls * tokens / total:>10.0f} tokens/s", flush=True)
    scorer.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per case")
    parser.add_argument("--hidden-size", type=int, default=256, help="reference model width")
    parser.add_argument("--layers", type=int, default=4, help="reference model depth")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8192, help="reference token budget per forward")
    args = parser.parse_args()

    with (
        tempfile.TemporaryDirectory(prefix="bench-score-") as tmp,
        ProcessLauncher(stop_grace_s=10) as launcher,
    ):
        print(f"building a tiny Qwen2 (hidden {args.hidden_size}, {args.layers} layers) in {tmp}", flush=True)
        model_dir = build_tiny_model(
            tmp,
            build_tokenizer(),
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=max(1, args.hidden_size // 64),
            num_kv_heads=max(1, args.hidden_size // 128),
            max_position_embeddings=max(1024, args.prompt_len + args.response_len),
        )
        print("starting the reward and reference services", flush=True)
        overrides = [
            f"actor_rollout_ref.model.path={model_dir}",
            f"rlmesh.reference.max_tokens={args.max_tokens}",
        ]
        stack = start_stack(launcher, None, overrides, services=("reward", "reference"))
        reward, reference = stack.get("reward"), stack.get("reference")
        print(f"reward at {reward.grpc_address}, reference at {reference.grpc_address}", flush=True)
        rows = asyncio.run(bench(reward.grpc_address, reference.grpc_address, args))

    print()
    print(f"| {'what':<24} | {'batch':>5} | {'throughput':>12} | {'unit':<9} | {'p50 ms/call':>11} |")
    print(f"|{'-' * 26}|{'-' * 7}|{'-' * 14}|{'-' * 11}|{'-' * 13}|")
    for what, size, rate, unit, p50 in rows:
        print(f"| {what:<24} | {size:>5} | {rate:>12,.0f} | {unit:<9} | {p50:>11.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
