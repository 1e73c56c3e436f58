"""``rlmesh demo``: the CPU demo — a tiny model learns the arithmetic task with PPO, every role
in its own process.

1. prepare (cached under the work dir): a char-level tokenizer and a tiny Qwen2 from a config,
   the arithmetic task in verl's layout, and a short supervised warm-up so the policy starts
   at a modest validation accuracy;
2. start a private Redis, the reward and reference services, two rollout replicas with
   embedded engines and the learner (DeepSpeed), each its own process on loopback;
3. run PPO (GAE with a critic, KL in reward with the adaptive controller, dual-clip) with a
   live progress line per step;
4. print a summary table, write the metrics JSONL and a PNG plot, export the actor as an HF
   directory, and end with one JSON line for scripts;
5. stop everything it started, also on Ctrl-C and on error.
"""

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

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO_ROOT / "examples" / "cpu_demo.yaml"


@dataclass
class Prepared:
    base_model: Path
    sft_model: Path
    train: Path
    test: Path
    sft_metrics: dict[str, Any]


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def prepare(
    workdir: Path,
    *,
    seed: int,
    sft_epochs: int,
    sft_lr: float,
    train_size: int,
    val_size: int,
    max_operand: int,
    ops: str,
    hidden_size: int,
    num_layers: int,
) -> Prepared:
    """Builds what the demo trains on; every piece is reused when its inputs did not change."""
    from rlmesh.data import generate_arithmetic
    from rlmesh.models import build_tiny_model, build_tokenizer

    spec = {
        "seed": seed,
        "train_size": train_size,
        "val_size": val_size,
        "max_operand": max_operand,
        "ops": ops,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "sft_epochs": sft_epochs,
        "sft_lr": sft_lr,
    }
    key = uuid.uuid5(uuid.NAMESPACE_OID, json.dumps(spec, sort_keys=True)).hex[:10]
    root = workdir / f"prepared-{key}"
    base, data, sft = root / "base-model", root / "data", root / "sft-model"
    if not (base / "config.json").exists():
        say(f"building a tiny Qwen2 (hidden {hidden_size}, {num_layers} layers) and a local char tokenizer")
        build_tiny_model(
            base,
            build_tokenizer(),
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=4,
            num_kv_heads=2,
            seed=seed,
        )
    if not (data / "test.parquet").exists():
        say(
            f"writing the arithmetic task ({train_size} train / {val_size} test, operands <= {max_operand}, ops {ops})"
        )
        generate_arithmetic(
            data,
            seed,
            train_size=train_size,
            val_size=val_size,
            min_terms=2,
            max_terms=2,
            max_operand=max_operand,
            ops=ops,
        )
    marker = sft / "rlmesh_sft.json"
    if marker.exists():
        say(f"supervised warm-up cached at {sft}")
        sft_metrics = json.loads(marker.read_text())
    else:
        from rlmesh.learner.sft import arithmetic_examples, run_sft
        from rlmesh.models.tokenizer import load_tokenizer

        say(f"supervised warm-up: {sft_epochs} epoch(s) on {train_size} examples")
        examples, _ = arithmetic_examples(str(data / "train.parquet"), load_tokenizer(base))
        result = run_sft(
            str(base),
            str(sft),
            examples,
            epochs=sft_epochs,
            lr=sft_lr,
            batch_size=32,
            seed=seed,
            log_fn=lambda msg: say(f"  sft: {msg}"),
        )
        sft_metrics = {k: v for k, v in (result or {}).items() if isinstance(v, int | float | str)}
        marker.write_text(json.dumps(sft_metrics))
    return Prepared(base, sft, data / "train.parquet", data / "test.parquet", sft_metrics)


def read_metrics(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(rows: list[dict[str, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[float], list[float]]:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, title) in zip(
        axes,
        [
            ("critic/score/mean", "training reward (mean score)"),
            ("actor/reward_kl_penalty", "KL to the reference"),
            ("val/score", "validation accuracy"),
        ],
        strict=True,
    ):
        x, y = series(key)
        ax.plot(x, y, marker="o" if key == "val/score" else None, markersize=4)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    axes[2].set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def engine_server_info(rollout_address: str) -> dict[str, Any]:
    """The ``/get_server_info`` of a rollout replica's engine (found through ``Rollout.GetInfo``)."""
    import urllib.request

    import grpc

    from rlmesh.v1 import common_pb2, rollout_pb2_grpc

    with grpc.insecure_channel(rollout_address) as channel:
        url = rollout_pb2_grpc.RolloutStub(channel).GetInfo(common_pb2.Empty(), timeout=10).engine_url
    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as resp:
        return json.loads(resp.read())


def stage_rates(rows: list[dict[str, float]], engines: Sequence[dict[str, Any]] = ()) -> dict[str, float]:
    """Tokens per second per stage: generation from the engines' own counters (tokens over the time
    each spent computing; the learner's wait for a batch says nothing of it when generation runs
    ahead, asynchronously), the rest from the learner's timings."""
    train = [r for r in rows if "timing_s/step" in r]
    if not train:
        return {}

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in train)

    tokens = total("training/tokens")
    response_tokens = total("training/response_tokens")
    update = total("timing_s/update_actor") + total("timing_s/update_critic")
    forward = total("timing_s/old_log_prob") + total("timing_s/values")
    generated = sum(float(e.get("tokens_generated", 0)) for e in engines)
    engine_busy = sum(float(e.get("busy_s", 0.0)) for e in engines)
    return {
        "generate_tokens_per_s": generated / engine_busy
        if engine_busy > 0
        else response_tokens / max(total("timing_s/gen"), 1e-9),
        "learner_forward_tokens_per_s": tokens / max(forward, 1e-9),
        "learner_update_tokens_per_s": tokens / max(update, 1e-9),
        "step_tokens_per_s": tokens / max(total("timing_s/step"), 1e-9),
    }


def prepare_from_args(args: argparse.Namespace) -> Prepared:
    return prepare(
        Path(args.workdir),
        seed=args.seed,
        sft_epochs=args.sft_epochs,
        sft_lr=args.sft_lr,
        train_size=args.train_size,
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
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        f"rlmesh.run_id={run_id}",
        f"rlmesh.max_staleness={args.max_staleness}",
        *args.overrides,
    ]
    if args.max_staleness > 0:
        overrides.append("algorithm.rollout_correction.rollout_is=token")
    return overrides


def run(args: argparse.Namespace) -> int:
    from rlmesh.runtime.launcher import ProcessLauncher

    t_start = time.monotonic()
    prepared = prepare_from_args(args)
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    run_dir = Path(args.workdir) / run_id
    overrides = run_overrides(args, prepared, run_dir, run_id)
    say(f"run {run_id}: logs and metrics in {run_dir}")
    t_ppo = time.monotonic()
    engines: list[dict[str, Any]] = []

    def read_engines(endpoints: dict[str, Any]) -> None:
        for address in endpoints["rollouts"]:
            try:
                engines.append(engine_server_info(address))
            except Exception as e:  # the summary falls back to the learner's timings
                say(f"could not read the engine counters of {address}: {e}")

    with ProcessLauncher(run_dir, stop_grace_s=30) as launcher:
        code = train(launcher, args, overrides, run_dir, before_stop=read_engines)
        t_train = time.monotonic() - t_start
        ppo_s = time.monotonic() - t_ppo
    if code != 0:
        say(f"the learner failed (exit code {code}); its log: {run_dir / 'logs' / 'learner.log'}")
        return code
    return summarize(args, prepared, run_dir, run_id, t_train, ppo_s, overrides, engines)


def print_step(step: int, total: int, m: dict[str, float], elapsed_s: float) -> None:
    val = f"{m['val/score']:.2f}" if "val/score" in m else "  - "
    print(
        f"[demo] step {step:>3}/{total}  reward {m.get('critic/score/mean', 0):.3f}  "
        f"kl {m.get('actor/reward_kl_penalty', 0):+.4f}  val acc {val}  "
        f"tok/s {m.get('perf/throughput', 0):>6.0f}  {m.get('timing_s/step', 0):.1f} s/step  [{elapsed_s:.0f} s]",
        flush=True,
    )


def train(
    launcher: Any, args: argparse.Namespace, overrides: list[str], run_dir: Path, before_stop: Any = None
) -> int:
    """Starts every service, follows the learner until it exits; ``before_stop(endpoints)`` runs
    while the other services are still up (benchmarks read their counters there)."""
    import grpc

    from rlmesh.runtime.launcher import LaunchError
    from rlmesh.v1 import common_pb2, learner_pb2, learner_pb2_grpc

    config = str(args.config)
    redis = launcher.start_redis()
    common = [*overrides, f"rlmesh.redis_url={redis.url}"]
    say(f"redis        {redis.url} (pid {redis.process.pid})")
    try:
        services = {}
        for name in ("reward", "reference"):
            services[name] = launcher.start_service(
                name,
                config_path=config,
                overrides=[*common, f"rlmesh.{name}.port=0", f"rlmesh.{name}.metrics_port=0"],
            )
            say(f"{name:<12} {services[name].grpc_address} (pid {services[name].process.pid})")
        peers = [
            f"rlmesh.reward.addresses=['{services['reward'].grpc_address}']",
            f"rlmesh.reference.addresses=['{services['reference'].grpc_address}']",
        ]
        replicas = []
        for i in range(args.replicas):
            replica = launcher.start_service(
                "rollout",
                name=f"rollout-{i}",
                config_path=config,
                overrides=[
                    *common,
                    *peers,
                    "rlmesh.rollout.port=0",
                    "rlmesh.rollout.metrics_port=0",
                    f"rlmesh.sampler.replica_id=rollout-{i}",
                ],
                timeout_s=300,
            )
            say(f"rollout-{i:<4} {replica.grpc_address} (pid {replica.process.pid}, embedded engine)")
            replicas.append(replica.grpc_address)
        learner = launcher.start_service(
            "learner",
            config_path=config,
            overrides=[*common, *peers, "rlmesh.learner.port=0", "rlmesh.learner.metrics_port=0"],
            timeout_s=600,
        )
        say(f"learner      {learner.grpc_address} (pid {learner.process.pid}, DeepSpeed)")
    except LaunchError as e:
        say(f"start-up failed: {e}")
        return 1

    channel = grpc.insecure_channel(learner.grpc_address)
    stub = learner_pb2_grpc.LearnerStub(channel)
    shown = -1
    started = time.monotonic()
    while learner.process.alive():
        try:
            st = stub.GetStatus(common_pb2.Empty(), timeout=5)
        except grpc.RpcError:
            time.sleep(0.5)
            continue
        if st.step != shown and st.step > 0:
            shown = st.step
            print_step(st.step, st.total_steps, dict(st.metrics), time.monotonic() - started)
        elif st.step == 0 and shown == -1:
            say(
                f"learner: {learner_pb2.LearnerPhase.Name(st.phase).removeprefix('LEARNER_PHASE_').lower()}"
                f"{' - ' + st.message if st.message else ''}"
            )
            shown = 0
        time.sleep(1.0)
    channel.close()
    code = learner.process.popen.wait()
    # The learner may finish between two polls: show the steps the progress line missed.
    for row in read_metrics(run_dir / "checkpoints" / "metrics.jsonl"):
        if row["step"] > max(shown, 0) and "timing_s/step" in row:
            print_step(int(row["step"]), int(args.steps), row, time.monotonic() - started)
    if before_stop is not None:
        before_stop(
            {
                "rollouts": replicas,
                "reference": services["reference"].grpc_address,
            }
        )
    return code


def summarize(
    args: argparse.Namespace,
    prepared: Prepared,
    run_dir: Path,
    run_id: str,
    wall_s: float,
    ppo_s: float,
    overrides: list[str],
    engines: Sequence[dict[str, Any]] = (),
) -> int:
    import subprocess

    rows = read_metrics(run_dir / "checkpoints" / "metrics.jsonl")
    vals = [r for r in rows if "val/score" in r]
    if len(vals) < 2:
        say("no before/after validation in the metrics; nothing to summarize")
        return 1
    acc_before, acc_after = vals[0]["val/score"], vals[-1]["val/score"]
    steps = int(max(r["step"] for r in rows))
    plot_path = run_dir / "demo.png"
    plot(rows, plot_path)
    from rlmesh.learner import latest_checkpoint

    checkpoint = latest_checkpoint(str(run_dir / "checkpoints"))
    export_dir = run_dir / "actor-hf"
    exported = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlmesh.cli",
            "export",
            "--checkpoint",
            str(checkpoint),
            "--out",
            str(export_dir),
            "--config",
            str(args.config),
            *overrides,
        ],
        capture_output=True,
        text=True,
    )
    if exported.returncode != 0:
        say(f"export failed:\n{exported.stderr[-2000:]}")
        return 1
    rates = stage_rates(rows, engines)
    print()
    print("  rlmesh CPU demo: PPO on arithmetic")
    print("  ----------------------------------------------")
    print(f"  validation accuracy before   {acc_before:7.1%}")
    print(f"  validation accuracy after    {acc_after:7.1%}   ({(acc_after - acc_before) * 100:+.1f} points)")
    print(f"  PPO steps                    {steps:7d}")
    print(f"  wall time                    {wall_s:7.0f} s   (PPO with every service: {ppo_s:.0f} s)")
    for key, value in rates.items():
        print(f"  {key.replace('_', ' '):<28} {value:7.0f}")
    print(f"  metrics   {run_dir / 'checkpoints' / 'metrics.jsonl'}")
    print(f"  plot      {plot_path}")
    print(f"  actor     {export_dir}")
    print()
    print(
        json.dumps(
            {
                "acc_before": acc_before,
                "acc_after": acc_after,
                "steps": steps,
                "wall_s": round(wall_s, 1),
                "ppo_wall_s": round(ppo_s, 1),
                **{k: round(v, 1) for k, v in rates.items()},
                "exported_actor": str(export_dir),
                "run_id": run_id,
            }
        ),
        flush=True,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlmesh demo", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="runs/demo", help="where prepared models, data and runs go")
    p.add_argument("--config", default=str(DEMO_CONFIG))
    p.add_argument("--steps", type=int, default=250, help="PPO steps")
    p.add_argument("--test-freq", type=int, default=25, help="validate every this many steps")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-staleness", type=int, default=0, help="1 = asynchronous (with IS correction)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-size", type=int, default=2300)
    p.add_argument("--val-size", type=int, default=200)
    p.add_argument("--max-operand", type=int, default=49)
    p.add_argument("--ops", default="+")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--sft-epochs", type=int, default=16)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("overrides", nargs="*", help="config overrides for every service")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if shutil.which("redis-server") is None:
        say(
            "redis-server is not installed: run `make demo` (it installs it) or `apt-get install redis-server`"
        )
        return 2
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
