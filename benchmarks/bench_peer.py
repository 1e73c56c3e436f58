"""make bench-peer: TRL 1.12's PPOTrainer and rlmesh on one task, from one SFT checkpoint, one after
the other; prints wall times, accuracies and rlmesh's time to TRL's final accuracy as a ratio.

    python benchmarks/bench_peer.py [--steps 100] [--seed 0] [--runs trl,trl-knobs,fast] [--threads N]

The task is TRL's own CPU PPO example, built here with nothing downloaded: a 4.2M-parameter Llama
(hidden 256, 4 layers, intermediate 1024) with rlmesh's character tokenizer, prompts ``a+b=`` (a, b
in 0..99, 256 held out as the test set), answers of at most 3 digits and eos (4 tokens), warmed up
by a seeded supervised run until greedy accuracy on a dev split reaches ``--sft-band`` (cached).

Both sides then run ``--steps`` PPO steps of 64 prompts (n = 1), 4 epochs over 2 mini-batches:
TRL in its own venv (benchmarks/peer_trl.py under .venv-trl), rlmesh with ``rlmesh train``, once
with TRL's knobs mapped to verl's keys (``trl-knobs``) and once with the config docs/benchmarks.md documents
as the fast one (``fast``). Accuracy is avg@8 on the 256 test prompts (the mean score of 8 answers
sampled at the training temperature per prompt; ``--eval-samples 0``: greedy), scored by
benchmarks/peer_reward.py on both sides, before training and every ``--eval-every`` steps; greedy
accuracy at the start and the end is shown too.

What is timed, between the same boundaries on both sides: the training steps only. A step's time
runs from the end of the previous step's work, its metrics logging and the loop's between-step work
included, to the end of its own work and logging; evaluation and process start-up are left out and
shown apart. TRL (benchmarks/peer_trl.py): from the end of the previous ``on_step_end`` (after its
evaluation) to this step's, which TRL calls after logging the step's metrics, so the previous
step's cache release and ``gc.collect`` count here. rlmesh: from the start of the step, which the
learner's loop reaches only once it has logged the previous one, to the start of the next, less
the validation between the step's end and its metrics row; the last step ends at its row. The
first step starts once the evaluation before training is done on both sides. "time to TRL's final
accuracy" is that training time summed up to the first evaluation at or above the accuracy TRL ends
with (TRL's own counts the same way: it may get there before its last step); the ratio divides
rlmesh's by TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
PEER_TRL = BENCH / "peer_trl.py"
PEER_REWARD = BENCH / "peer_reward.py"
DATA_SOURCE = "peer_arithmetic"
MAX_OPERAND = 99  # a, b in 0..99: answers of at most 3 digits
# The acceptance targets of issue 16: the fast config reaches TRL's final accuracy in at most half
# TRL's time; with TRL's own knobs rlmesh takes no longer per step than TRL.
FAST_RATIO_TARGET = 0.5
KNOBS_RATIO_TARGET = 1.0


def say(msg: str) -> None:
    print(f"[bench-peer] {msg}", flush=True)


# ---------------------------------------------------------------------------------------- knobs


@dataclass(frozen=True)
class Knobs:
    """The PPO knobs both sides run with (TRL's names, TRL's values for this task)."""

    steps: int = 100
    batch: int = 64  # prompts per step, n = 1
    mini_batches: int = 2
    ppo_epochs: int = 4
    lr: float = 3e-5
    kl_coef: float = 0.05
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    temperature: float = 1.0
    response_length: int = 4
    eval_every: int = 5
    eval_samples: int = 8  # the accuracy: avg@k, k sampled answers per test prompt; 0 = greedy
    seed: int = 0

    @property
    def metric(self) -> str:
        return f"avg@{self.eval_samples}" if self.eval_samples else "greedy"


def trl_args(knobs: Knobs) -> list[str]:
    """peer_trl.py's command-line options for these knobs."""
    return [
        f"--steps={knobs.steps}",
        f"--eval-every={knobs.eval_every}",
        f"--eval-samples={knobs.eval_samples}",
        f"--seed={knobs.seed}",
        f"--batch={knobs.batch}",
        f"--mini-batches={knobs.mini_batches}",
        f"--ppo-epochs={knobs.ppo_epochs}",
        f"--lr={knobs.lr}",
        f"--kl-coef={knobs.kl_coef}",
        f"--cliprange={knobs.cliprange}",
        f"--cliprange-value={knobs.cliprange_value}",
        f"--vf-coef={knobs.vf_coef}",
        f"--gamma={knobs.gamma}",
        f"--lam={knobs.lam}",
        f"--temperature={knobs.temperature}",
        f"--response-length={knobs.response_length}",
    ]


def trl_knobs_overrides(knobs: Knobs) -> dict[str, Any]:
    """TRL's PPOTrainer as verl keys: GAE with a critic initialised from the policy, a fixed k1 KL
    penalty in the reward, advantages whitened per batch (verl's GAE does, as TRL does), no entropy
    bonus, no KL loss, no gradient clipping, no dual-clip (TRL has neither), AdamW without weight
    decay at a constant rate for actor and critic alike (TRL's one optimizer over both; its
    ``vf_coef`` only scales the critic's gradient, which Adam's normalisation undoes), every
    mini-batch one micro-batch and one optimizer step, the samples reshuffled each epoch."""
    mini = knobs.batch // knobs.mini_batches
    optim = {
        "lr": knobs.lr,
        "lr_scheduler_type": "constant",
        "lr_warmup_steps": 0,
        "lr_warmup_steps_ratio": 0.0,
        "weight_decay": 0.0,
        "betas": "[0.9,0.999]",
    }
    ds = {"deepspeed_config.zero_stage": 0, "deepspeed_config.dtype": "float32"}
    o: dict[str, Any] = {
        "data.train_batch_size": knobs.batch,
        "data.max_prompt_length": 8,
        "data.max_response_length": knobs.response_length,
        "data.shuffle": True,
        "data.seed": knobs.seed,
        "actor_rollout_ref.model.enable_gradient_checkpointing": False,
        "actor_rollout_ref.actor.ppo_mini_batch_size": mini,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": mini,
        "actor_rollout_ref.actor.ppo_epochs": knobs.ppo_epochs,
        "actor_rollout_ref.actor.shuffle": True,
        "actor_rollout_ref.actor.clip_ratio": knobs.cliprange,
        "actor_rollout_ref.actor.clip_ratio_low": knobs.cliprange,
        "actor_rollout_ref.actor.clip_ratio_high": knobs.cliprange,
        "actor_rollout_ref.actor.clip_ratio_c": 1e9,  # no dual-clip
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.grad_clip": 0.0,
        **{f"actor_rollout_ref.actor.optim.{k}": v for k, v in optim.items()},
        **{f"actor_rollout_ref.actor.{k}": v for k, v in ds.items()},
        "actor_rollout_ref.rollout.name": "embedded",
        "actor_rollout_ref.rollout.n": 1,
        "actor_rollout_ref.rollout.temperature": knobs.temperature,
        "actor_rollout_ref.rollout.top_p": 1.0,
        "actor_rollout_ref.rollout.top_k": -1,
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": knobs.batch,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": knobs.batch,
        "critic.model.enable_gradient_checkpointing": False,
        "critic.ppo_mini_batch_size": mini,
        "critic.ppo_micro_batch_size_per_gpu": mini,
        "critic.forward_micro_batch_size_per_gpu": knobs.batch,
        "critic.ppo_epochs": knobs.ppo_epochs,
        "critic.cliprange_value": knobs.cliprange_value,
        "critic.grad_clip": 0.0,
        **{f"critic.optim.{k}": v for k, v in optim.items()},
        **{f"critic.{k}": v for k, v in ds.items()},
        "algorithm.adv_estimator": "gae",
        "algorithm.gamma": knobs.gamma,
        "algorithm.lam": knobs.lam,
        "algorithm.use_kl_in_reward": True,
        "algorithm.kl_penalty": "kl",
        "algorithm.kl_ctrl.type": "fixed",
        "algorithm.kl_ctrl.kl_coef": knobs.kl_coef,
        # TRL's old log-probs are its generation's own (log-softmax of generate()'s scores), with no
        # second forward of the policy: verl's bypass mode, fed by the replicas' log-probs.
        "algorithm.rollout_correction.bypass_mode": True,
        "trainer.critic_warmup": 0,
        "rlmesh.max_staleness": 0,
    }
    return o


# The config docs/benchmarks.md documents as rlmesh's fast one for this task (the same model, data, reward,
# KL penalty, clip range and batch): no critic (REINFORCE++: returns whitened over the batch, which
# n = 1 allows), half the PPO epochs at a higher learning rate, gradients clipped as verl does.
FAST_OVERRIDES: dict[str, Any] = {
    "algorithm.adv_estimator": "reinforce_plus_plus",
    "actor_rollout_ref.actor.ppo_epochs": 2,
    "actor_rollout_ref.actor.optim.lr": 6e-5,
    "actor_rollout_ref.actor.grad_clip": 1.0,
}

RUNS = ("trl", "trl-knobs", "fast")


def rlmesh_overrides(
    knobs: Knobs,
    run: str,
    *,
    model: Path,
    train: Path,
    test: Path,
    out_dir: Path,
    replicas: int = 2,
    threads: int = 1,
    steps: int | None = None,
) -> dict[str, Any]:
    """Every key=value ``rlmesh train`` gets for one of the rlmesh runs (``trl-knobs`` or ``fast``);
    ``threads`` torch threads for the learner, as many as TRL's process gets; ``steps`` PPO steps
    (default TRL's)."""
    steps = steps or knobs.steps
    if run not in ("trl-knobs", "fast"):
        raise ValueError(f"not an rlmesh run: {run!r}")
    o = trl_knobs_overrides(knobs)
    o.update(
        {
            "data.train_files": str(train),
            "data.val_files": str(test),
            "actor_rollout_ref.model.path": str(model),
            "critic.model.path": str(model),
            "custom_reward_function.path": str(PEER_REWARD),
            "custom_reward_function.name": "compute_score",
            "trainer.device": "cpu",
            "trainer.n_gpus_per_node": 0,
            "trainer.total_epochs": 1,
            "trainer.total_training_steps": steps,
            "trainer.test_freq": knobs.eval_every,
            "trainer.val_before_train": True,
            # One checkpoint, after the last step: the exported actor's greedy accuracy is read from it.
            "trainer.save_freq": steps,
            "trainer.logger": "[console]",
            "trainer.project_name": "bench_peer",
            "trainer.experiment_name": run,
            "trainer.default_local_dir": str(out_dir),
            "rlmesh.log_format": "text",
            # The reference's forward in the learner, as TRL's (and verl's) is: no service, no RPC.
            "rlmesh.reference.colocated": True,
            "rlmesh.rollout.replicas": replicas,
            # Synchronous steps leave the replicas idle while the learner trains: it may use every core.
            "rlmesh.learner.torch_threads": threads,
            "rlmesh.sampler.engine_max_batch_size": knobs.batch,
            "rlmesh.sampler.tasks_in_flight": knobs.batch,
        }
    )
    if knobs.eval_samples:  # validation samples as training does, k answers per prompt
        o.update(
            {
                "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
                "actor_rollout_ref.rollout.val_kwargs.temperature": knobs.temperature,
                "actor_rollout_ref.rollout.val_kwargs.n": knobs.eval_samples,
                "actor_rollout_ref.rollout.val_kwargs.top_p": 1.0,
                "actor_rollout_ref.rollout.val_kwargs.top_k": -1,
            }
        )
    if run == "fast":
        o.update(FAST_OVERRIDES)
    return o


def as_cli(overrides: dict[str, Any]) -> list[str]:
    def text(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v)

    return [f"{k}={text(v)}" for k, v in overrides.items()]


# ---------------------------------------------------------------------------------------- results


def time_to_accuracy(
    evals: Sequence[dict[str, float]], target: float, window: int = 1
) -> dict[str, float] | None:
    """The first evaluation (in step order) where the mean accuracy of the last ``window``
    evaluations, it included, is at or above ``target``: its step, the training time up to it and
    that mean; None when none got there. Accuracies are fractions of a fixed sample count, so a
    1e-9 slack absorbs float noise only."""
    ordered = sorted(evals, key=lambda e: e["step"])
    for i in range(window - 1, len(ordered)):
        mean = sum(e["acc"] for e in ordered[i - window + 1 : i + 1]) / window
        if mean >= target - 1e-9:
            e = ordered[i]
            return {"step": e["step"], "train_s": e["train_s"], "acc": mean}
    return None


def lift_significant(start: float, final: float, prompts: int, samples: int = 1) -> bool:
    """Whether ``final`` is more than two standard errors above ``start``. The test prompts are
    fixed, so the noise of an evaluation is its sampling's: at most p(1 - p) / (prompts x answers
    per prompt); a greedy one counts one answer per prompt. Otherwise a time to ``final`` measures
    noise."""
    se = (max(start * (1 - start), 1e-6) / (prompts * max(samples, 1))) ** 0.5
    return final - start > 2 * se


def rlmesh_timeline(rows: Sequence[dict[str, float]]) -> tuple[list[dict[str, float]], list[float], float]:
    """From a run's metrics.jsonl rows: the evaluations (step, accuracy, training time up to that
    step), each step's time, and the time the evaluations took. A step's work ends at
    ``timing_start/step + timing_s/step`` (weights pushed, the step committed); its validation, if
    any, and its metrics logging follow, and the next step starts after them (its
    ``timing_start/step``), the last one's end being its row's ``time``. A step's time is from the
    previous step's end to its own less its validation, which runs from its work's end to its row."""
    step_rows = sorted((r for r in rows if "timing_s/step" in r), key=lambda r: r["step"])
    starts = [float(r["timing_start/step"]) for r in step_rows]
    step_s, cumulative, eval_s, elapsed = [], {0: 0.0}, 0.0, 0.0
    # The first step starts once the validation before training (its own row) is logged.
    previous_end = starts[0] if starts else 0.0
    for i, r in enumerate(step_rows):
        work_end = starts[i] + float(r["timing_s/step"])
        validation = max(0.0, float(r["time"]) - work_end) if "val/score" in r else 0.0
        end = starts[i + 1] if i + 1 < len(step_rows) else float(r["time"])
        took = end - previous_end - validation
        previous_end = end
        step_s.append(took)
        elapsed += took
        cumulative[int(r["step"])] = elapsed
        eval_s += validation
    evals = [
        {"step": int(r["step"]), "acc": float(r["val/score"]), "train_s": cumulative[int(r["step"])]}
        for r in sorted((r for r in rows if "val/score" in r), key=lambda r: r["step"])
        if int(r["step"]) in cumulative
    ]
    return evals, step_s, eval_s


def summarize(
    results: dict[str, dict[str, Any]], test_prompts: int = 256, samples: int = 8, final_evals: int = 3
) -> dict[str, Any]:
    """Per run: steps, training time, s/step, start and final accuracy, time to TRL's final accuracy
    and its ratio to TRL's, also at the run's median pace (the step where it got there times its
    median step time: what the run takes without the bursts of other work a shared machine adds).
    ``results[name]`` has ``evals`` (step, acc, train_s), ``step_s``, ``eval_s`` and optionally
    ``greedy_start`` / ``greedy_final``. TRL's final accuracy is the mean of its last
    ``final_evals`` evaluations (one evaluation swings by a few points). ``trl_lift_significant``
    says whether TRL ended more than two standard errors above where it started (``samples``
    answers to each of ``test_prompts`` prompts): otherwise a time to it measures noise."""
    trl = results.get("trl")
    target, window = None, 1
    if trl and trl["evals"]:
        window = max(1, min(final_evals, len(trl["evals"]) - 1))
        last = sorted(trl["evals"], key=lambda e: e["step"])[-window:]
        target = sum(e["acc"] for e in last) / window
    # Every run, TRL's own included, is judged by the same running mean as the target: reaching it
    # is reaching TRL's level, not one evaluation's lucky swing above it.
    trl_tta = time_to_accuracy(trl["evals"], target, window) if target is not None else None
    out: dict[str, Any] = {"target_acc": target, "window": window, "trl_lift_significant": None, "runs": {}}
    if target is not None:
        out["trl_lift_significant"] = lift_significant(trl["evals"][0]["acc"], target, test_prompts, samples)
    trl_median = statistics.median(trl["step_s"]) if trl and trl["step_s"] else None
    trl_tta_median = trl_tta["step"] * trl_median if trl_tta is not None and trl_median else None
    for name, r in results.items():
        steps = len(r["step_s"])
        train_s = sum(r["step_s"])
        evals = r["evals"]
        median = statistics.median(r["step_s"]) if steps else None
        row = {
            "steps": steps,
            "train_s": train_s,
            "s_per_step": train_s / steps if steps else None,
            "s_per_step_median": median,
            "eval_s": r.get("eval_s"),
            "process_s": r.get("process_s"),
            "acc_start": evals[0]["acc"] if evals else None,
            "acc_final": evals[-1]["acc"] if evals else None,
            "acc_best": max((e["acc"] for e in evals), default=None),
            "greedy_start": r.get("greedy_start"),
            "greedy_final": r.get("greedy_final"),
            "tta": None,
            "tta_ratio": None,
            "tta_median_ratio": None,
            "s_per_step_ratio": None,
            "s_per_step_median_ratio": None,
        }
        if target is not None:
            tta = time_to_accuracy(evals, target, window)
            row["tta"] = tta
            if tta is not None and trl_tta is not None and trl_tta["train_s"] > 0:
                row["tta_ratio"] = tta["train_s"] / trl_tta["train_s"]
            if tta is not None and trl_tta_median and median is not None:
                row["tta_median_ratio"] = tta["step"] * median / trl_tta_median
        if trl and name != "trl" and trl["step_s"] and steps:
            row["s_per_step_ratio"] = row["s_per_step"] / (sum(trl["step_s"]) / len(trl["step_s"]))
            row["s_per_step_median_ratio"] = median / trl_median
        out["runs"][name] = row
    return out


def table(summary: dict[str, Any], labels: dict[str, str], metric: str = "avg@8") -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        f"| system / config | steps | train time | s/step (median) | eval time | {metric} start | "
        f"{metric} final | greedy start -> final | time to TRL's final {metric} | ratio vs TRL (at median "
        "pace) | s/step vs TRL (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in summary["runs"].items():
        tta = r["tta"]
        tta_text = "not reached" if tta is None else f"{tta['train_s']:.1f} s (step {tta['step']})"
        lines.append(
            f"| {labels.get(name, name)} | {r['steps']} | {f(r['train_s'], '.0f')} s | "
            f"{f(r['s_per_step'], '.2f')} ({f(r.get('s_per_step_median'), '.2f')}) | "
            f"{f(r['eval_s'], '.0f')} s | {f(r['acc_start'], '.1%')} | {f(r['acc_final'], '.1%')} | "
            f"{f(r['greedy_start'], '.1%')} -> {f(r['greedy_final'], '.1%')} | {tta_text} | "
            f"{f(r['tta_ratio'], '.2f')} ({f(r.get('tta_median_ratio'), '.2f')}) | "
            f"{f(r['s_per_step_ratio'], '.2f')} ({f(r.get('s_per_step_median_ratio'), '.2f')}) |"
        )
    return "\n".join(lines)


def verdicts(summary: dict[str, Any]) -> list[str]:
    runs = summary["runs"]
    out = []
    if summary.get("trl_lift_significant") is False:
        out.append(
            "TRL ended within two standard errors of its start: a time to TRL's final accuracy measures "
            "noise here, whatever the ratio says"
        )
    # Met only if both the wall-time ratio and the one at median pace are: a burst of other work on
    # the machine during one side's run moves the first, not the second.
    fast = runs.get("fast")
    if fast is not None and "trl" in runs:
        ratio, at_median = fast["tta_ratio"], fast.get("tta_median_ratio")
        ok = (
            ratio is not None
            and at_median is not None
            and max(ratio, at_median) <= FAST_RATIO_TARGET
            and summary.get("trl_lift_significant") is not False
        )
        shown = "not reached" if ratio is None else f"{ratio:.2f}x ({at_median:.2f}x at median pace)"
        out.append(
            f"fast config: time to TRL's final accuracy {shown} TRL's (target <= {FAST_RATIO_TARGET}x): "
            f"{'met' if ok else 'MISSED'}"
        )
    knobs = runs.get("trl-knobs")
    if knobs is not None and "trl" in runs:
        ratio, at_median = knobs["s_per_step_ratio"], knobs.get("s_per_step_median_ratio")
        ok = ratio is not None and at_median is not None and max(ratio, at_median) <= KNOBS_RATIO_TARGET
        shown = "-" if ratio is None else f"{ratio:.2f}x ({at_median:.2f}x median)"
        out.append(
            f"TRL's knobs: {shown} TRL's time per step (target <= {KNOBS_RATIO_TARGET}x): "
            f"{'met' if ok else 'MISSED'}"
        )
    return out


# ---------------------------------------------------------------------------------------- the task


def split_pairs(seed: int, test_size: int = 256, dev_size: int = 256) -> dict[str, list[tuple[int, int]]]:
    """Every (a, b) with a, b in 0..MAX_OPERAND, shuffled by ``seed`` into test, dev and train."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    return {
        "test": pairs[:test_size],
        "dev": pairs[test_size : test_size + dev_size],
        "train": pairs[test_size + dev_size :],
    }


def task_row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    """One verl-layout row; the prompt is a raw string (no chat template), as TRL's task has it."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": f"{a}+{b}=",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


@dataclass
class Prepared:
    model: Path  # the SFT checkpoint both sides start from
    train: Path
    dev: Path
    test: Path
    sft: dict[str, Any]  # the warm-up's record, with ``test_greedy``: the start's greedy accuracy


def prepare(workdir: Path, seed: int, sft_band: float, sft_max_epochs: int) -> Prepared:
    """The tokenizer, the 4.2M Llama, the task's Parquet files and the SFT checkpoint; cached under
    ``workdir/prepared-<key>`` (a second run with the same inputs reuses them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import GenerationConfig

    from rlmesh.data import RLHFDataset
    from rlmesh.models import build_tokenizer, load_tokenizer

    spec = {
        "seed": seed,
        "band": sft_band,
        "max_epochs": sft_max_epochs,
        "arch": "llama-256x4-1024",
        "v": 1,
    }
    key = uuid.uuid5(uuid.NAMESPACE_OID, json.dumps(spec, sort_keys=True)).hex[:10]
    root = workdir / f"prepared-{key}"
    base, data, sft = root / "base-model", root / "data", root / "sft-model"
    paths = {s: data / f"{s}.parquet" for s in ("train", "dev", "test")}
    if not (base / "config.json").exists():
        say("building a 4.2M-parameter Llama (hidden 256, 4 layers, intermediate 1024) and a char tokenizer")
        tokenizer = build_tokenizer()
        build_llama(base, tokenizer, seed, max_position_embeddings=64)
        # One stop token on both sides (TRL's stop_token takes one): eos, not also <|im_end|>.
        eos = tokenizer.eos_token_id
        GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(str(base))
    if not paths["test"].exists():
        splits = split_pairs(seed)
        say(
            f"writing the task: a+b= with a, b in 0..{MAX_OPERAND}: {len(splits['train'])} train / "
            f"{len(splits['dev'])} dev / {len(splits['test'])} test prompts"
        )
        data.mkdir(parents=True, exist_ok=True)
        for split, pairs in splits.items():
            rows = [task_row(a, b, split, i) for i, (a, b) in enumerate(pairs)]
            pq.write_table(pa.Table.from_pylist(rows), str(paths[split]))
    marker = sft / "bench_peer_sft.json"
    if marker.exists():
        sft_result = json.loads(marker.read_text())
        say(
            f"SFT checkpoint cached at {sft} (dev accuracy {sft_result['dev_score']:.3f}, "
            f"test {sft_result['test_greedy']:.3f})"
        )
    else:
        tokenizer = load_tokenizer(base)
        train_items = RLHFDataset(str(paths["train"]), tokenizer, max_prompt_length=8).items
        dev_items = RLHFDataset(str(paths["dev"]), tokenizer, max_prompt_length=8).items
        examples = [
            (
                list(it.prompt_ids),
                [*tokenizer.encode(str(it.ground_truth), add_special_tokens=False), tokenizer.eos_token_id],
            )
            for it in train_items
        ]
        sys.path.insert(0, str(BENCH))
        from peer_reward import score_answer

        def dev_accuracy(model: Any) -> float:
            return greedy_accuracy(
                model, tokenizer, [(it.prompt_ids, it.ground_truth) for it in dev_items], score_answer
            )

        say(
            f"supervised warm-up on {len(examples)} examples until greedy accuracy on {len(dev_items)} dev "
            f"prompts reaches {sft_band:.0%} (at most {sft_max_epochs} epochs)"
        )
        t0 = time.monotonic()
        result = supervised_warmup(
            base, sft, examples, dev_accuracy, band=sft_band, max_epochs=sft_max_epochs, seed=seed
        )
        if not result["reached"]:
            raise SystemExit(
                f"[bench-peer] the warm-up reached dev accuracy {result['dev_score']:.3f}, not {sft_band}, in "
                f"{sft_max_epochs} epochs; raise --sft-max-epochs"
            )
        sft_result = {k: v for k, v in result.items() if k != "reached"}
        sft_result["sft_s"] = round(time.monotonic() - t0, 1)
        sft_result["test_greedy"] = test_greedy_accuracy(sft, paths["test"])
        marker.write_text(json.dumps(sft_result))
        say(
            f"SFT done in {sft_result['sft_s']:.0f} s: dev accuracy {sft_result['dev_score']:.3f}, "
            f"test {sft_result['test_greedy']:.3f}"
        )
    return Prepared(sft, paths["train"], paths["dev"], paths["test"], sft_result)


def build_llama(
    path: Path, tokenizer: Any, seed: int, max_position_embeddings: int, hidden_size: int = 256
) -> Path:
    """A 4-layer Llama, 4 heads, intermediate 4x hidden; at hidden 256 TRL's CPU PPO example's model
    (4.2M parameters)."""
    from rlmesh.models import build_tiny_model

    return build_tiny_model(
        path,
        tokenizer,
        arch="llama",
        hidden_size=hidden_size,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
    )


def test_greedy_accuracy(model_dir: Path, test: Path) -> float:
    """Greedy accuracy of the model in ``model_dir`` on the test split, with plain HF generate."""
    from transformers import AutoModelForCausalLM

    from rlmesh.data import RLHFDataset
    from rlmesh.models import load_tokenizer

    sys.path.insert(0, str(BENCH))
    from peer_reward import score_answer

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    items = RLHFDataset(str(test), tokenizer, max_prompt_length=8).items
    return greedy_accuracy(model, tokenizer, [(it.prompt_ids, it.ground_truth) for it in items], score_answer)


def supervised_warmup(
    base: Path,
    out: Path,
    examples: list[tuple[list[int], list[int]]],
    dev_accuracy: Any,
    *,
    band: float,
    max_epochs: int,
    seed: int,
    lr: float = 1e-3,
    batch_size: int = 64,
    eval_every: int = 20,
    betas: tuple[float, float] = (0.9, 0.98),
    on_eval: Any = None,
) -> dict[str, Any]:
    """A plain seeded torch loop: AdamW on the answer tokens (and eos) of ``prompt + answer`` rows,
    shuffled each epoch, until ``dev_accuracy(model)`` (checked every ``eval_every`` optimizer
    steps) reaches ``band``; the model is saved to ``out`` with its tokenizer either way."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlmesh.learner.checkpoints.hf_dir import copy_tokenizer
    from rlmesh.learner.sft import collate_sft, sft_loss

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    pad = model.config.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=betas)
    steps, acc, reached, evals = 0, 0.0, False, []
    t0 = time.monotonic()
    for epoch in range(1, max_epochs + 1):
        order = list(range(len(examples)))
        rng.shuffle(order)
        model.train()
        for start in range(0, len(order), batch_size):
            batch = collate_sft([examples[i] for i in order[start : start + batch_size]], pad)
            loss, _ = sft_loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if steps % eval_every == 0:
                acc = dev_accuracy(model)
                evals.append([steps, acc])
                say(
                    f"  sft epoch {epoch}, step {steps}: loss {loss.item():.3f}, dev accuracy {acc:.3f} "
                    f"[{time.monotonic() - t0:.0f} s]"
                )
                if on_eval is not None:
                    on_eval(steps, acc, model)
                reached = acc >= band
                if reached:
                    break
        if reached:
            break
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    copy_tokenizer(str(base), out)
    return {"steps": steps, "epochs": epoch, "dev_score": acc, "reached": reached, "evals": evals, "lr": lr}


def greedy_accuracy(model: Any, tokenizer: Any, items: Sequence[tuple[list[int], Any]], score: Any) -> float:
    """Greedy answers (4 tokens at most, left-padded batch) scored by ``score(text, ground_truth)``."""
    import torch

    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (ids, _) in enumerate(items):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        mask[i, width - len(ids) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    model.train(was_training)
    return sum(score(t, gt) for t, (_, gt) in zip(texts, items, strict=True)) / len(items)


# ---------------------------------------------------------------------------------------- running


def stream(
    argv: list[str], prefix: str, env: dict[str, str] | None = None, keep: list[str] | None = None
) -> tuple[int, float]:
    """Runs argv, printing its output line by line (with prefix, and appended to ``keep`` when
    given: a thread may read them as they come); returns its exit code and wall time."""
    t0 = time.monotonic()
    with subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    ) as p:
        assert p.stdout is not None
        for line in p.stdout:
            print(f"{prefix}{line}", end="", flush=True)
            if keep is not None:
                keep.append(line.rstrip("\n"))
    return p.returncode, time.monotonic() - t0


def run_trl(args: argparse.Namespace, knobs: Knobs, prep: Prepared, outdir: Path) -> dict[str, Any]:
    out = outdir / "trl.json"
    argv = [
        str(REPO / args.trl_python),
        "-u",
        str(PEER_TRL),
        f"--model={prep.model}",
        f"--train={prep.train}",
        f"--test={prep.test}",
        f"--out={out}",
        f"--workdir={outdir / 'trl-output'}",
        f"--threads={args.threads}",
        *trl_args(knobs),
    ]
    say(f"TRL: {knobs.steps} steps in {args.trl_python} ({args.threads} torch thread(s))")
    code, wall = stream(argv, "", env={"OMP_NUM_THREADS": str(args.threads)})
    if code != 0:
        raise SystemExit(f"[bench-peer] the TRL run failed (exit code {code})")
    r = json.loads(out.read_text())
    key = "sampled" if knobs.eval_samples else "greedy"
    return {
        "evals": [{"step": e["step"], "acc": e[key], "train_s": e["train_s"]} for e in r["evals"]],
        "step_s": [s["train_s"] for s in r["step_log"]],
        "eval_s": r["eval_s"],
        "process_s": wall,
        "greedy_start": r["evals"][0]["greedy"],
        "greedy_final": r["evals"][-1]["greedy"],
        "detail": {
            "setup_s": r["setup_s"],
            "trl_version": r["trl_version"],
            "params": r["params"],
            "result": str(out),
        },
    }


def run_rlmesh(
    args: argparse.Namespace, knobs: Knobs, prep: Prepared, outdir: Path, run: str
) -> dict[str, Any]:
    from rlmesh.job.report import read_metrics

    run_dir = outdir / f"rlmesh-{run}"
    # Judged by its time to TRL's final accuracy, the fast config may take more (cheaper) steps.
    steps = (args.fast_steps or 2 * knobs.steps) if run == "fast" else knobs.steps
    overrides = rlmesh_overrides(
        knobs,
        run,
        model=prep.model,
        train=prep.train,
        test=prep.test,
        out_dir=run_dir,
        replicas=args.replicas,
        threads=args.threads,
        steps=steps,
    )
    extra = args.rlmesh_override if run in args.override_runs.split(",") else []
    overrides.update(dict(kv.split("=", 1) for kv in extra))
    argv = [sys.executable, "-m", "rlmesh.cli", "train", *as_cli(overrides)]
    keys = [*(FAST_OVERRIDES if run == "fast" else ()), *(kv.split("=", 1)[0] for kv in extra)]
    changed = as_cli({k: overrides[k] for k in dict.fromkeys(keys)})
    say(
        f"rlmesh ({run}): rlmesh train, {steps} steps, TRL's knobs"
        + (" but " + " ".join(changed) if changed else "")
    )
    code, wall = stream(argv, f"[{run}] ")
    if code != 0:
        raise SystemExit(f"[bench-peer] the rlmesh run {run} failed (exit code {code}); logs under {run_dir}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals, step_s, eval_s = rlmesh_timeline(rows)
    actor = run_dir / "actor-hf"
    greedy_final = test_greedy_accuracy(actor, prep.test) if (actor / "config.json").exists() else None
    return {
        "evals": evals,
        "step_s": step_s,
        "eval_s": eval_s,
        "process_s": wall,
        "greedy_start": prep.sft.get("test_greedy"),
        "greedy_final": greedy_final,
        "detail": {"overrides": as_cli(overrides), "metrics": str(run_dir / "metrics.jsonl")},
    }


LABELS = {
    "trl": "TRL 1.12 PPOTrainer (1 process)",
    "trl-knobs": "rlmesh, TRL's knobs",
    "fast": "rlmesh, fast config",
}


def main(argv: Sequence[str] | None = None) -> int:
    defaults = Knobs()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=defaults.steps, help="PPO steps of every run")
    p.add_argument("--seed", type=int, default=defaults.seed, help="task split, model, warm-up and PPO seed")
    p.add_argument("--lr", type=float, default=defaults.lr, help="TRL's learning rate (and trl-knobs')")
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument(
        "--eval-samples",
        type=int,
        default=defaults.eval_samples,
        help="accuracy = mean over this many sampled answers per test prompt (avg@k); 0 = greedy",
    )
    p.add_argument("--runs", default=",".join(RUNS), help=f"which runs, in order: any of {', '.join(RUNS)}")
    p.add_argument("--workdir", default="runs/bench-peer")
    p.add_argument("--sft-band", type=float, default=0.30, help="warm up until dev accuracy reaches this")
    p.add_argument("--sft-max-epochs", type=int, default=20)
    p.add_argument("--trl-python", default=".venv-trl/bin/python")
    p.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads of TRL's process and of rlmesh's learner (default: this machine's cores)",
    )
    p.add_argument("--trl-result", default=None, help="an earlier run's results.json: reuse its TRL run")
    p.add_argument("--replicas", type=int, default=2, help="rlmesh rollout replicas")
    p.add_argument(
        "--fast-steps",
        type=int,
        default=0,
        help="PPO steps of the fast run (default twice --steps: it is judged by its time to TRL's final "
        "accuracy, not by its steps)",
    )
    p.add_argument("--rlmesh-override", action="append", default=[], help="extra key=value for rlmesh runs")
    p.add_argument("--override-runs", default="trl-knobs,fast", help="the runs --rlmesh-override applies to")
    args = p.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    if bad := [r for r in runs if r not in RUNS]:
        p.error(f"unknown runs {bad}; known: {', '.join(RUNS)}")
    knobs = Knobs(
        steps=args.steps,
        seed=args.seed,
        lr=args.lr,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
    )
    workdir = REPO / args.workdir
    t0 = time.monotonic()
    prep = prepare(workdir, args.seed, args.sft_band, args.sft_max_epochs)
    outdir = workdir / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    outdir.mkdir(parents=True)
    say(f"results in {outdir}; accuracy = {knobs.metric} on the test prompts")
    results: dict[str, dict[str, Any]] = {}
    if args.trl_result:
        results["trl"] = json.loads(Path(args.trl_result).read_text())["results"]["trl"]
        say(f"TRL: reusing the run in {args.trl_result}")
    summary = summarize(results, samples=knobs.eval_samples)
    for run in runs:
        if run == "trl":
            if not args.trl_result:
                results["trl"] = run_trl(args, knobs, prep, outdir)
        else:
            results[run] = run_rlmesh(args, knobs, prep, outdir, run)
        summary = summarize(results, samples=knobs.eval_samples)
        record = {"knobs": asdict(knobs), "sft": prep.sft, "summary": summary, "results": results}
        (outdir / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    print()
    target = summary["target_acc"]
    print(
        f"  bench-peer: {knobs.steps} PPO steps of {knobs.batch} prompts (n = 1), seed {knobs.seed}; accuracy = "
        f"{knobs.metric} on the test prompts" + (f"; TRL's final {target:.1%}" if target is not None else "")
    )
    print()
    print(table(summary, LABELS, knobs.metric))
    print()
    for line in verdicts(summary):
        print(f"  {line}")
    print(
        "\n  train time: the training steps alone; evaluation (eval time) and process start-up are not in it."
        f"\n  everything took {time.monotonic() - t0:.0f} s; results: {outdir / 'results.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
