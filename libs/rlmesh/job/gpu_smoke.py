"""`make gpu-smoke`: the driver, torch's CUDA and sglang, a learner step on CUDA, a 5-step job with
the learner on CUDA and a CPU replica, and one on SGLang, reported in one JSON line.
docs/sglang.md#gpu-smoke"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def say(message: str) -> None:
    print(f"[gpu-smoke] {message}", flush=True)


def version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """The driver (nvidia-smi), torch and its CUDA, the GPUs torch sees, sglang's version."""
    import torch

    found: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "sglang": version_of("sglang"),
        "deepspeed": version_of("deepspeed"),
        "driver": None,
    }
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        found["driver"] = (
            out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        )
    return found


def deepspeed_step(workdir: Path, device: str = "cuda", dtype: str = "bfloat16") -> dict[str, Any]:
    """One actor step as the learner takes it (``build_engine``: ZeRO-1, bf16) on CUDA: the weights
    must change and the loss must be finite. (``device``, ``dtype``: the same step on the CPU in
    float32, which is how it is tested where there is no GPU.)"""
    import torch

    from rlmesh.config import EngineSettings, OptimConfig
    from rlmesh.learner.dist import init_distributed
    from rlmesh.learner.ppo.deepspeed_engine import build_engine
    from rlmesh.models import build_tiny_model, build_tokenizer

    path = build_tiny_model(workdir / "model", build_tokenizer(), hidden_size=64, num_layers=2)
    init_distributed(device=device)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).to(device)
    settings = EngineSettings(zero_stage=1, offload_optimizer=False, offload_param=False, dtype=dtype)
    engine, _ = build_engine(model, OptimConfig(lr=1e-3), settings, grad_clip=1.0, world_size=1)
    before = [p.detach().float().clone() for p in engine.module.parameters()]
    ids = torch.randint(0, model.config.vocab_size, (4, 32), device=device)
    t0 = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    if device == "cuda":
        torch.cuda.synchronize()
    changed = any(
        not torch.equal(b, p.detach().float())
        for b, p in zip(before, engine.module.parameters(), strict=True)
    )
    ok = bool(torch.isfinite(loss).item()) and changed
    return {"ok": ok, "loss": loss.item(), "weights_changed": changed, "seconds": time.perf_counter() - t0}


def sglang_job(
    workdir: Path,
    gpus: int,
    steps: int,
    *,
    engine: str = "sglang",
    device: str = "cuda",
    replicas: int = 1,
    group_size: int = 1,
) -> dict[str, Any]:
    """``rlmesh train`` for ``steps`` steps: a tiny Qwen2 and the arithmetic task built here, one
    SGLang replica, the learner on CUDA; its own processes, its logs under ``workdir``. (``engine``,
    ``device``: the same job on the CPU engine, which is how it is tested where there is no GPU.)
    ``replicas`` engines in weight groups of ``group_size`` (``rlmesh.weight_sync.group_size``):
    with more than one, some step's push must have reached them all over fewer groups."""
    from rlmesh.data import generate_arithmetic
    from rlmesh.models import build_tiny_model, build_tokenizer

    model = build_tiny_model(workdir / "qwen2", build_tokenizer(), hidden_size=64, num_layers=2)
    data = workdir / "data"
    generate_arithmetic(data, 0, train_size=64, val_size=8, dev_size=8, min_terms=2, max_terms=2)
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        "data.train_batch_size=8",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        f"actor_rollout_ref.rollout.name={engine}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.n=2",
        f"rlmesh.rollout.replicas={replicas}",
        f"rlmesh.weight_sync.group_size={group_size}",
        "algorithm.adv_estimator=grpo",
        f"trainer.device={device}",
        *([f"trainer.n_gpus_per_node={min(gpus, 2)}"] if gpus else []),
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=['console','file']",
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", "train", "--no-export", *overrides], cwd=workdir, timeout=480
    )
    metrics = sorted(workdir.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in metrics[-1].read_text().splitlines()] if metrics else []
    steps_done = [r for r in rows if "training/global_step" in r]
    # Steps whose push reached every replica over fewer groups than replicas: a shared group.
    shared = sum(
        r.get("weight_sync/engines") == replicas and r.get("weight_sync/groups", replicas) < replicas
        for r in steps_done
    )
    return {
        "ok": proc.returncode == 0 and len(steps_done) >= steps and (group_size == 1 or shared > 0),
        "steps_pushed_over_shared_groups": shared,
        "exit_code": proc.returncode,
        "steps": len(steps_done),
        "weight_sync": "nccl" if gpus >= 2 and engine == "sglang" else "gloo",
        "step_s": [round(r["timing_s/step"], 3) for r in steps_done],
        "seconds": time.perf_counter() - t0,
        "logs": str(workdir),
    }


CHECKS = ("deepspeed_step", "cuda_learner_job", "sglang_job")


def run(steps: int, keep: Path | None) -> dict[str, Any]:
    report: dict[str, Any] = {"environment": environment()}
    env = report["environment"]
    say(json.dumps(env))
    if not env["cuda_available"]:
        for name in CHECKS:
            report[name] = {"ok": None, "skipped": "no CUDA device"}
        report["ok"] = False
        return report
    workdir = keep or Path(tempfile.mkdtemp(prefix="rlmesh-gpu-smoke-"))
    for name, check in (
        ("deepspeed_step", lambda: deepspeed_step(workdir / "ds")),
        # The learner on CUDA, the embedded engine on the CPU: CUDA tensors pushed over gloo.
        (
            "cuda_learner_job",
            lambda: sglang_job(
                workdir / "cuda-learner",
                len(env["gpus"]),
                steps,
                engine="embedded",
                device="cuda",
                replicas=2,
                group_size=2,  # both engines in one gloo group: one broadcast of CUDA tensors
            ),
        ),
        ("sglang_job", lambda: sglang_job(workdir / "job", len(env["gpus"]), steps)),
    ):
        if name == "sglang_job" and importlib.util.find_spec("sglang") is None:
            report[name] = {"ok": None, "skipped": "sglang is not installed (pip install -e '.[gpu]')"}
            continue
        say(f"{name} ...")
        try:
            report[name] = check()
        except Exception as e:  # each check reports its own failure; the next still runs
            report[name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-2000:],
            }
        say(f"{name}: {json.dumps(report[name])}")
    report["ok"] = all(report[k].get("ok") is not False for k in CHECKS)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlmesh.job.gpu_smoke", description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep it (default: a temp dir)")
    args = parser.parse_args(argv)
    report = run(args.steps, args.keep)
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
