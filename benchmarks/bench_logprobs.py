"""Peak memory and time of ``logprobs_from_logits`` against ``log_softmax`` + ``gather``.

Run: ``python benchmarks/bench_logprobs.py [--shape 8 512 32000] [--reps 3]``

Each (implementation, mode) runs in its own subprocess so the process-wide peak RSS
(``resource.getrusage(...).ru_maxrss``) belongs to that run alone. The reported peak is the rise
of that high-water mark over the baseline taken right after the logits were allocated, i.e. the
extra memory the computation needed on top of its input. Modes:

- ``no_grad``: forward only, as when the learner computes old/ref log-probs.
- ``grad``: forward + backward of ``sum(logprobs)`` with ``logits.requires_grad``, as in the
  actor update. A gradient-sized buffer is allocated before the baseline and released before
  the first run, so the gradient that backward returns is charged to neither implementation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

from rlmesh.algo import logprobs_from_logits

IMPLEMENTATIONS = ("log_softmax+gather", "logprobs_from_logits")
MODES = ("no_grad", "grad")


def _naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _peak_rss_mib() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _inputs(shape: list[int], requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*shape, generator=gen)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return logits.requires_grad_(requires_grad), labels


def _run_once(fn, logits: torch.Tensor, labels: torch.Tensor, mode: str) -> None:
    if mode == "grad":
        logits.grad = None
        fn(logits, labels).sum().backward()
    else:
        with torch.no_grad():
            fn(logits, labels)


def worker(impl: str, mode: str, shape: list[int], reps: int) -> dict:
    fn = _naive if impl == IMPLEMENTATIONS[0] else logprobs_from_logits
    logits, labels = _inputs(shape, requires_grad=mode == "grad")
    if mode == "grad":
        # Charge the returned gradient to neither side: its pages are in the baseline and are
        # handed back (and reused) when _run_once clears .grad.
        logits.grad = torch.zeros_like(logits)
    baseline = _peak_rss_mib()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        _run_once(fn, logits, labels, mode)
        times.append(time.perf_counter() - start)
    return {
        "impl": impl,
        "mode": mode,
        "input_mib": logits.numel() * logits.element_size() / 2**20,
        "extra_peak_mib": _peak_rss_mib() - baseline,
        "best_s": min(times),
    }


def check(shape: list[int]) -> float:
    logits, labels = _inputs(shape, requires_grad=False)
    with torch.no_grad():
        return (logprobs_from_logits(logits, labels) - _naive(logits, labels)).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[8, 512, 32000])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.shape, args.reps)))
        return
    if args.check:
        print(json.dumps({"max_abs_diff": check(args.shape)}))
        return

    print(
        f"logits {tuple(args.shape)} fp32, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, {args.reps} reps per run",
        flush=True,
    )
    shape_args = ["--shape", *map(str, args.shape)]
    results = []
    for mode in MODES:
        for impl in IMPLEMENTATIONS:
            print(f"  running {impl} [{mode}] ...", flush=True)
            out = subprocess.run(
                [sys.executable, __file__, "--worker", impl, mode, "--reps", str(args.reps), *shape_args],
                check=True,
                capture_output=True,
                text=True,
            )
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("  checking agreement ...", flush=True)
    out = subprocess.run(
        [sys.executable, __file__, "--check", *shape_args], check=True, capture_output=True, text=True
    )
    max_abs_diff = json.loads(out.stdout.strip().splitlines()[-1])["max_abs_diff"]

    print()
    print(f"input logits: {results[0]['input_mib']:.0f} MiB")
    print(f"{'mode':<8} {'implementation':<22} {'extra peak MiB':>15} {'best time s':>12}")
    for r in results:
        print(f"{r['mode']:<8} {r['impl']:<22} {r['extra_peak_mib']:>15.1f} {r['best_s']:>12.3f}")
    for mode in MODES:
        naive, ours = (r for r in results if r["mode"] == mode)
        saved = naive["extra_peak_mib"] - ours["extra_peak_mib"]
        print(f"{mode}: logprobs_from_logits needs {saved:.0f} MiB less peak memory than log_softmax+gather")
    print(f"max |logprobs_from_logits - log_softmax+gather| = {max_abs_diff:.2e}")


if __name__ == "__main__":
    main()
