"""make bench-rollout: the embedded engine against plain HF ``generate``, and the weight push
against raw loopback TCP.

1. tokens/s at batch 1, 8 and 32: the engine (a real server process, requests over HTTP) and
   ``model.generate`` in this process, same model, prompts and lengths (greedy, no early stop).
   Target: >= 2x HF generate at batch 32.
2. weight push: seconds and GB/s of ``WeightPusher.push`` to one engine over gloo, against
   the time raw TCP on loopback takes for the same bytes, measured in the same run.
   Target: push time <= 1.5x the loopback wire time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from transformers import AutoModelForCausalLM

from rlmesh.engine.client import EngineClient
from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.runtime.launcher import ProcessLauncher, free_port
from rlmesh.weights.push import WeightPusher

torch.set_num_threads(1)


def prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(1, 90, (batch, length), generator=g).tolist()


def hf_tokens_per_s(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.tensor(prompts(batch, prompt_len))
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return batch * new_tokens / (time.perf_counter() - start)


async def engine_tokens_per_s(url: str, batch: int, prompt_len: int, new_tokens: int) -> float:
    client = EngineClient(url)
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    try:
        await client.generate(prompts(1, prompt_len)[0], {**sp, "max_new_tokens": 2})  # warm-up
        start = time.perf_counter()
        # Concurrent single requests, as the sampler sends them: the engine batches them itself.
        await asyncio.gather(
            *(client.generate(p, sp, return_logprob=True) for p in prompts(batch, prompt_len))
        )
        return batch * new_tokens / (time.perf_counter() - start)
    finally:
        await client.aclose()


def loopback_seconds(nbytes: int) -> float:
    port = free_port()
    server = socket.create_server(("127.0.0.1", port))
    payload = bytearray(8 << 20)

    def sink() -> None:
        conn, _ = server.accept()
        remaining = nbytes
        buf = bytearray(8 << 20)
        while remaining > 0:
            remaining -= conn.recv_into(buf, min(len(buf), remaining))
        conn.sendall(b"k")
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        start = time.perf_counter()
        sent = 0
        while sent < nbytes:
            n = min(len(payload), nbytes - sent)
            c.sendall(memoryview(payload)[:n])
            sent += n
        c.recv(1)
        elapsed = time.perf_counter() - start
    t.join()
    server.close()
    return elapsed


async def push_seconds(url: str, model) -> tuple[float, int]:
    client = EngineClient(url, timeout_s=600)
    pusher = WeightPusher([client], backend="gloo", timeout_s=300)
    try:
        await pusher.push(model.state_dict().items(), version=1)  # builds the group
        report = await pusher.push(model.state_dict().items(), version=2)
        return report.seconds, report.bytes_per_engine
    finally:
        await pusher.close()
        await client.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    with ProcessLauncher(stop_grace_s=10) as launcher:
        model_dir = build_tiny_model(
            launcher.workdir / "model", build_tokenizer(), hidden_size=args.hidden, num_layers=args.layers
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        params = sum(p.numel() for p in model.parameters())
        print(
            f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M params", flush=True
        )
        engine = launcher.start_engine(model_dir, extra_args=["--max-batch-size", "64"])
        print(f"{'batch':>5} {'HF generate tok/s':>18} {'engine tok/s':>13} {'ratio':>6}", flush=True)
        ratios = {}
        for batch in (1, 8, 32):
            hf = hf_tokens_per_s(model, batch, args.prompt_len, args.new_tokens)
            eng = asyncio.run(engine_tokens_per_s(engine.url, batch, args.prompt_len, args.new_tokens))
            ratios[batch] = eng / hf
            print(f"{batch:>5} {hf:>18.0f} {eng:>13.0f} {eng / hf:>5.2f}x", flush=True)
        seconds, nbytes = asyncio.run(push_seconds(engine.url, model))
        wire = loopback_seconds(nbytes)
        print(
            f"weight push: {nbytes / 1e6:.1f} MB in {seconds:.3f} s ({nbytes / seconds / 1e9:.2f} GB/s); "
            f"raw loopback TCP {wire:.3f} s ({nbytes / wire / 1e9:.2f} GB/s): {seconds / wire:.2f}x the wire time",
            flush=True,
        )
    print(
        f"targets: engine >= 2x HF at batch 32: {'met' if ratios[32] >= 2 else 'MISSED'} ({ratios[32]:.2f}x); "
        f"push <= 1.5x wire: {'met' if seconds <= 1.5 * wire else 'MISSED'} ({seconds / wire:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
