"""``rlmesh demo``: the CPU demo — a tiny model learns the arithmetic task with PPO, every role
in its own process: a cached preparation, then exactly ``rlmesh train``. docs/train.md#rlmesh-demo"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlmesh.job.train import say_with

# Shipped inside the package (examples/cpu_demo.yaml links to it), so an installed rlmesh has it.
DEMO_CONFIG = Path(__file__).resolve().with_name("cpu_demo.yaml")
# Names under the work dir that always point at the latest preparation: the demo config's
# actor_rollout_ref.model.path and data files, and docker-compose.yml's defaults, read them.
LATEST_MODEL, LATEST_DATA = "model", "data"
# Dev accuracy is checked this often (optimizer steps of 32 examples) during the warm-up.
SFT_EVAL_EVERY = 10
WARMUP_BAND = 0.25
# Adam's second-moment horizon shortened from 1000 to 50 steps: the tiny model sat on its
# plateau (~8% dev accuracy) for 30+ epochs with 0.999 and left it around epoch 27 with 0.98.
SFT_BETAS = (0.9, 0.98)
# Whole tokens for the chat roles and the prompt's fixed wording, as a real BPE vocabulary has them:
# one token per character made a prompt 53 tokens for 4 characters of problem, and every forward
# and update of the run paid for them.
DEMO_WORDS = ("user", "assistant", "What", " is", " Answer", " after", "####")


@dataclass
class Prepared:
    base_model: Path
    sft_model: Path
    train: Path
    dev: Path
    test: Path
    sft_metrics: dict[str, Any]
    warmup_s: float  # 0 when the warm-up was cached


say = say_with("demo")


def prepare(
    workdir: Path,
    *,
    seed: int,
    sft_max_epochs: int,
    sft_lr: float,
    warmup_band: float,
    train_size: int,
    dev_size: int,
    val_size: int,
    max_operand: int,
    ops: str,
    hidden_size: int,
    num_layers: int,
) -> Prepared:
    """Builds what the demo trains on; every piece is reused when its inputs did not change.

    The warm-up stops once greedy accuracy on the dev split reaches ``warmup_band``, so every
    machine starts PPO from the same band whatever its numerics do to the warm-up's path.
    """
    from rlmesh.data import RLHFDataset, generate_arithmetic
    from rlmesh.models import build_tiny_model, build_tokenizer

    spec = {
        "seed": seed,
        "train_size": train_size,
        "dev_size": dev_size,
        "val_size": val_size,
        "max_operand": max_operand,
        "ops": ops,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "sft_max_epochs": sft_max_epochs,
        "sft_lr": sft_lr,
        "warmup_band": warmup_band,
        "sft_betas": SFT_BETAS,
        "sft_eval_every": SFT_EVAL_EVERY,
        "words": DEMO_WORDS,
    }
    key = uuid.uuid5(uuid.NAMESPACE_OID, json.dumps(spec, sort_keys=True)).hex[:10]
    root = workdir / f"prepared-{key}"
    base, data, sft = root / "base-model", root / "data", root / "sft-model"
    if not (base / "config.json").exists():
        say(f"building a tiny Qwen2 (hidden {hidden_size}, {num_layers} layers) and a local char tokenizer")
        build_tiny_model(
            base,
            build_tokenizer(words=DEMO_WORDS),
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=4,
            num_kv_heads=2,
            seed=seed,
        )
    if not (data / "dev.parquet").exists():
        say(
            f"writing the arithmetic task ({train_size} train / {dev_size} dev / {val_size} test, "
            f"operands <= {max_operand}, ops {ops})"
        )
        generate_arithmetic(
            data,
            seed,
            train_size=train_size,
            val_size=val_size,
            dev_size=dev_size,
            min_terms=2,
            max_terms=2,
            max_operand=max_operand,
            ops=ops,
        )
    marker = sft / "rlmesh_sft.json"
    warmup_s = 0.0
    if marker.exists():
        sft_metrics = json.loads(marker.read_text())
        say(f"supervised warm-up cached at {sft} (dev score {sft_metrics.get('dev_score', 0):.3f})")
    else:
        from rlmesh.learner.sft import arithmetic_examples, greedy_accuracy, run_sft
        from rlmesh.models.tokenizer import load_tokenizer

        t0 = time.monotonic()
        tokenizer = load_tokenizer(base)
        examples, _ = arithmetic_examples(str(data / "train.parquet"), tokenizer)
        dev = RLHFDataset(str(data / "dev.parquet"), tokenizer, max_prompt_length=512).items
        say(
            f"supervised warm-up on {len(examples)} examples until greedy accuracy on {len(dev)} held-out "
            f"dev problems reaches {warmup_band:.0%} (at most {sft_max_epochs} epochs)"
        )
        result = run_sft(
            str(base),
            str(sft),
            examples,
            epochs=sft_max_epochs,
            lr=sft_lr,
            batch_size=32,
            seed=seed,
            log_fn=lambda msg: say(f"  {msg}"),
            evaluate=lambda model: greedy_accuracy(model, tokenizer, dev, max_new_tokens=12),
            eval_every=SFT_EVAL_EVERY,
            stop_at=warmup_band,
            betas=SFT_BETAS,
        )
        if not result["reached"]:
            # Not cached: a later run tries again rather than starting PPO from a weak policy.
            raise SystemExit(
                f"[demo] the warm-up reached a dev score of {result['dev_score']:.3f}, not {warmup_band:.2f}, "
                f"in {sft_max_epochs} epochs; raise --sft-max-epochs"
            )
        warmup_s = time.monotonic() - t0
        sft_metrics = {k: v for k, v in result.items() if isinstance(v, int | float | str)}
        sft_metrics["warmup_s"] = round(warmup_s, 1)
        marker.write_text(json.dumps(sft_metrics))
        say(f"supervised warm-up done in {warmup_s:.0f} s: dev score {result['dev_score']:.3f}")
    prepared = Prepared(
        base, sft, data / "train.parquet", data / "dev.parquet", data / "test.parquet", sft_metrics, warmup_s
    )
    link_latest(workdir, prepared)
    return prepared


def link_latest(workdir: Path, prepared: Prepared) -> None:
    """Points ``workdir/model`` at the warmed-up model and ``workdir/data`` at the task's data.

    The links are relative (``prepared-<key>/sft-model``), so they still resolve when the work dir
    is moved or mounted elsewhere (docker-compose.yml mounts ./runs into its containers), and each
    is replaced in one rename. A real file or directory under either name is left as it is.
    """
    for name, target in ((LATEST_MODEL, prepared.sft_model), (LATEST_DATA, prepared.train.parent)):
        link = workdir / name
        if link.exists() and not link.is_symlink():
            say(f"{link} is not a link: left as it is (the demo's {name} is {target})")
            continue
        tmp = workdir / f".{name}.{uuid.uuid4().hex[:8]}"
        tmp.symlink_to(os.path.relpath(target, workdir), target_is_directory=True)
        os.replace(tmp, link)


def prepare_from_args(args: argparse.Namespace) -> Prepared:
    return prepare(
        Path(args.workdir),
        seed=args.seed,
        sft_max_epochs=args.sft_max_epochs,
        sft_lr=args.sft_lr,
        warmup_band=args.warmup_band,
        train_size=args.train_size,
        dev_size=args.dev_size,
        val_size=args.val_size,
        max_operand=args.max_operand,
        ops=args.ops,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
    )


def run_overrides(args: argparse.Namespace, prepared: Prepared, run_dir: Path, run_id: str) -> list[str]:
    """The config overrides every service of one demo run gets."""
    overrides = [
        f"actor_rollout_ref.model.path={prepared.sft_model}",
        f"data.train_files={prepared.train}",
        f"data.val_files={prepared.test}",
        f"data.seed={args.seed}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        f"rlmesh.run_id={run_id}",
        f"rlmesh.max_staleness={args.max_staleness}",
        f"rlmesh.rollout.replicas={args.replicas}",
        *args.overrides,
    ]
    if args.max_staleness > 0:
        overrides.append("algorithm.rollout_correction.rollout_is=token")
    return overrides


def run(args: argparse.Namespace) -> int:
    from rlmesh.job.train import run_job, summarize

    t0 = time.monotonic()
    prepared = prepare_from_args(args)
    if args.prepare_only:
        # docker-compose.yml's prepare service: the model and data on the shared volume, no run.
        say(f"prepared: model {prepared.sft_model}, data {prepared.train.parent}")
        return 0
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    run_dir = Path(args.workdir) / run_id
    overrides = run_overrides(args, prepared, run_dir, run_id)
    result = run_job(args.config, overrides, service_dir=run_dir, say=say, export=True)
    if result.code != 0:
        say(f"failed: {result.failure}")
        return result.code
    extra = {
        "seed": args.seed,
        "warmup_dev_score": prepared.sft_metrics.get("dev_score"),
        "warmup_s": round(prepared.warmup_s, 1),
        "warmup_cached": prepared.warmup_s == 0.0,
    }
    if prepared.warmup_s:
        say(
            f"the warm-up took {prepared.warmup_s:.0f} s (not counted in the wall time below; cached from now on)"
        )
    # The wall time: everything from the command's start to the exported actor, the warm-up aside.
    return summarize(
        result,
        f"rlmesh CPU demo: PPO on arithmetic (seed {args.seed})",
        extra=extra,
        started_at=t0 + prepared.warmup_s,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlmesh demo", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="runs/demo", help="where prepared models, data and runs go")
    p.add_argument("--config", default=str(DEMO_CONFIG))
    p.add_argument("--steps", type=int, default=280, help="PPO steps")
    p.add_argument("--test-freq", type=int, default=25, help="validate every this many steps")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-staleness", type=int, default=0, help="1 = asynchronous (with IS correction)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-size", type=int, default=2100)
    p.add_argument("--dev-size", type=int, default=200, help="held-out problems the warm-up stops on")
    p.add_argument("--val-size", type=int, default=200, help="held-out problems PPO validates on")
    p.add_argument("--max-operand", type=int, default=49)
    p.add_argument("--ops", default="+")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument(
        "--warmup-band", type=float, default=WARMUP_BAND, help="dev accuracy that ends the warm-up"
    )
    p.add_argument(
        "--sft-max-epochs", type=int, default=80, help="the warm-up fails if not in the band by then"
    )
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="build the model and data (and warm up) under --workdir, then exit: no run",
    )
    p.add_argument("overrides", nargs="*", help="config overrides for every service")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = build_parser().parse_args(argv)
    if shutil.which("redis-server") is None and not args.prepare_only:
        say(
            "redis-server is not installed: run `make demo` (it installs it) or `apt-get install redis-server`"
        )
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
