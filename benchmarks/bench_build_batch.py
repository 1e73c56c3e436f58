"""build_batch alone on one synthetic step: seconds and page faults per build, against another commit.

    python benchmarks/bench_build_batch.py [--trajectories 16384] [--response-tokens 4096]
        [--rounds 3] [--compare REV]

Trajectories of a 512-token prompt and a response of half to all of ``--response-tokens`` tokens
(ids up to Qwen2's vocabulary, rollout and reference log-probs), built once; then ``build_batch``
at the fixed widths, ``--rounds`` times. With ``--compare REV`` the ``build_batch`` of that commit
(``git show REV:libs/rlmesh/learner/ppo/batch.py``) runs too, alternating with this tree's in the
same process, so both meet the same memory. ``kept buffers`` is the learner's way: a
``BatchBuilder`` fed a group of 16 at a time into arrays a ``BatchBuffers`` keeps from one build
to the next. Each line: seconds and minor page faults (memory the kernel handed the build anew).
docs/scale.md quotes it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "libs"))

BATCH_MODULE = "libs/rlmesh/learner/ppo/batch.py"
PROMPT_TOKENS = 512


def module_at(rev: str, workdir: Path) -> ModuleType:
    """``build_batch``'s module as commit ``rev`` has it, loaded under a name of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{BATCH_MODULE}"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    path = workdir / f"batch_{rev}.py"
    path.write_text(source)
    name = f"batch_at_{rev}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def synthetic_step(trajectories: int, response_tokens: int) -> list:
    import numpy as np

    from rlmesh.v1.trajectory_pb2 import Trajectory

    rng = np.random.default_rng(0)
    out = []
    for i in range(trajectories):
        n = int(rng.integers(response_tokens // 2, response_tokens + 1))
        t = Trajectory(uid=f"g{i // 16}/{i % 16}", group_uid=f"g{i // 16}", score=1.0, policy_version=3)
        t.prompt_ids.extend(rng.integers(0, 152_064, PROMPT_TOKENS).tolist())
        t.response_ids.extend(rng.integers(0, 152_064, n).tolist())
        t.rollout_log_probs.extend((-rng.random(n)).tolist())
        t.ref_log_probs.extend((-rng.random(n)).tolist())
        out.append(t)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=16_384)
    p.add_argument("--response-tokens", type=int, default=4_096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compare", metavar="REV", help="also time build_batch as this commit has it")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from rlmesh.learner.ppo import batch as this_tree

    torch.set_num_threads(1)
    builds: dict[str, ModuleType | SimpleNamespace] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.compare:
            builds[args.compare] = module_at(args.compare, Path(tmp))
        builds["this tree"] = this_tree
        buffers = this_tree.BatchBuffers()

        def kept_buffers(step: list, pad: int, max_prompt_length: int, max_response_length: int) -> object:
            builder = this_tree.BatchBuilder(
                pad,
                rows=len(step),
                max_prompt_length=max_prompt_length,
                max_response_length=max_response_length,
                with_ref=True,
                buffers=buffers,
            )
            for i in range(0, len(step), 16):
                builder.add(step[i : i + 16])
            return builder.finish()

        builds["kept buffers"] = SimpleNamespace(build_batch=kept_buffers)
        t0 = time.perf_counter()
        step = synthetic_step(args.trajectories, args.response_tokens)
        print(
            f"{args.trajectories:,} trajectories x {args.response_tokens:,} response tokens "
            f"(prompt {PROMPT_TOKENS}): made in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        for round_ in range(args.rounds):
            for name, module in builds.items():
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                batch = module.build_batch(
                    step, 0, max_prompt_length=PROMPT_TOKENS, max_response_length=args.response_tokens
                )
                seconds = time.perf_counter() - t0
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                print(
                    f"round {round_} {name}: {seconds:.2f} s, {faults:,} page faults "
                    f"({faults * resource.getpagesize() / 1e9:.1f} GB)",
                    flush=True,
                )
                del batch
    return 0


if __name__ == "__main__":
    sys.exit(main())
