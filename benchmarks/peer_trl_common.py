"""What both TRL sides of the peer benchmarks share (benchmarks/peer_trl.py, TRL 1.12's PPOTrainer,
and benchmarks/peer_trl_grpo.py, TRL's GRPOTrainer): the task, the tokenizer, accuracy on the test
split and a callback that times the steps with the evaluation apart. torch, transformers, pyarrow
only: it runs in either TRL venv."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from transformers import PreTrainedTokenizerFast, TrainerCallback

# TRL treats every pad id as padding and finds a response's end at its first pad, so pad must not
# be eos (rlmesh's char tokenizer pads with eos); <|unk|> is a special token the SFT never emits.
TRL_PAD_TOKEN = "<|unk|>"

Score = Callable[[str, str], float]
# The trainer arguments of a run on this CPU that logs every step to the recorder and saves nothing.
CPU_RUN = {
    "bf16": False,
    "use_cpu": True,
    "gradient_checkpointing": False,
    "report_to": "none",
    "save_strategy": "no",
    "logging_steps": 1,
    "disable_tqdm": True,
}  # (response text, ground truth) -> score


def say(msg: str) -> None:
    print(f"[trl] {msg}", flush=True)


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tok.pad_token = TRL_PAD_TOKEN
    tok.padding_side = "left"  # TRL: response = query_response[:, padded query width:]
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        raise SystemExit(f"the tokenizer in {model_dir} has no {TRL_PAD_TOKEN} distinct from eos")
    return tok


def load_task(path: str, tok: PreTrainedTokenizerFast) -> list[tuple[str, str]]:
    """(prompt text, ground truth) per row of a verl-layout Parquet file. A raw-string prompt is
    taken as it is; a chat prompt is rendered with the tokenizer's chat template and the generation
    prompt, as rlmesh's dataset renders it."""
    table = pq.read_table(path, columns=["prompt", "reward_model"]).to_pylist()
    out = []
    for row in table:
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            prompt = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        out.append((prompt, str(row["reward_model"]["ground_truth"])))
    return out


@torch.no_grad()
def accuracy(
    policy: Any,
    tok: PreTrainedTokenizerFast,
    task: list[tuple[str, str]],
    max_new_tokens: int,
    score: Score,
    *,
    samples: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """Mean score of the answers to every test prompt (at most max_new_tokens, stopping at eos):
    greedy ones (samples = 0), or ``samples`` sampled ones per prompt at ``temperature`` over the
    whole vocabulary, as rlmesh's validation with ``val_kwargs.n`` does. The sampling runs on its
    own seeded RNG: training's random stream is left as it was."""
    was_training = policy.training
    policy.eval()
    rows = [row for row in task for _ in range(max(samples, 1))]
    correct = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, len(rows), 512):
            chunk = rows[i : i + 512]
            enc = tok([p for p, _ in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            out = policy.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tok.pad_token_id,
                # The model's stop tokens (e.g. <|im_end|> too), as rlmesh's validation stops.
                eos_token_id=stop_ids(policy, tok),
                **(sampling if samples else {"do_sample": False}),
            )
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(score(t, gt) for t, (_, gt) in zip(texts, chunk, strict=True))
    policy.train(was_training)
    return correct / len(rows)


def stop_ids(policy: Any, tok: PreTrainedTokenizerFast) -> list[int]:
    """The ids generation stops at: the model's generation config's, else the tokenizer's eos."""
    config = getattr(policy, "generation_config", None)
    eos = config.eos_token_id if config is not None and config.eos_token_id is not None else tok.eos_token_id
    return list(eos) if isinstance(eos, list | tuple) else [eos]


class Recorder(TrainerCallback):
    """Per-step training time, the step's logged metrics (``shown``: label -> TRL's log key), and
    accuracy every ``a.eval_every`` steps, the evaluation timed apart. A step is
    ``optimizer_steps_per_step`` of TRL's optimizer steps (its ``global_step``): GRPO's one
    generation feeds that many."""

    def __init__(
        self,
        policy: Any,
        tok: PreTrainedTokenizerFast,
        test: list[tuple[str, str]],
        a: argparse.Namespace,
        score: Score,
        shown: dict[str, str],
        optimizer_steps_per_step: int = 1,
    ) -> None:
        self.policy, self.tok, self.test, self.a, self.score = policy, tok, test, a, score
        self.shown, self.per_step = shown, optimizer_steps_per_step
        self.total, self.eval_every = a.steps, a.eval_every
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, float]] = []
        self.eval_s = 0.0
        self.train_s = 0.0
        self.last_log: dict[str, float] = {}
        self.mark = time.monotonic()

    def evaluate(self, step: int) -> dict[str, float]:
        t0 = time.monotonic()
        a = self.a
        greedy = accuracy(self.policy, self.tok, self.test, a.response_length, self.score)
        sampled = (
            accuracy(
                self.policy,
                self.tok,
                self.test,
                a.response_length,
                self.score,
                samples=a.eval_samples,
                temperature=a.temperature,
                seed=a.seed * 100_003 + step,
            )
            if a.eval_samples
            else greedy
        )
        took = time.monotonic() - t0
        self.eval_s += took
        e = {"step": step, "greedy": greedy, "sampled": sampled, "train_s": self.train_s, "eval_s": took}
        self.evals.append(e)
        return e

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.last_log = dict(logs or {})

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.per_step:
            return  # the step's generation goes on feeding optimizer steps
        took = time.monotonic() - self.mark
        self.train_s += took
        step = state.global_step // self.per_step
        m = self.last_log
        self.steps.append({"step": step, "train_s": took, **{k: m.get(v) for k, v in self.shown.items()}})
        k = self.a.eval_samples
        val = "   -  /   -  " if k else "   -  "
        if step % self.eval_every == 0 or step == self.total:
            e = self.evaluate(step)
            val = f"{e['sampled']:.3f} / {e['greedy']:.3f}" if k else f"{e['greedy']:.3f}"
        eta = self.train_s / step * (self.total - step)
        metrics = "  ".join(f"{k} {m.get(v) or 0:+.4f}" for k, v in self.shown.items())
        say(
            f"step {step:>3}/{self.total}  {metrics}  val {f'avg@{k}/greedy' if k else 'greedy'} {val}  "
            f"{took:.2f} s/step  [train {self.train_s:.0f} s, eta {eta:.0f} s]"
        )
        self.mark = time.monotonic()


def train_and_record(
    trainer: Any, recorder: Recorder, a: argparse.Namespace, system: str, t_start: float
) -> int:
    """Scores the start, trains, and writes the result file ``a.out``: the steps' times and metrics,
    the evaluations, the start-up (from ``t_start``, the process's first line) and the knobs."""
    import trl

    params = sum(x.numel() for x in recorder.policy.parameters())
    e0 = recorder.evaluate(0)
    setup_s = time.monotonic() - t_start - recorder.eval_s
    k = a.eval_samples
    val = f"avg@{k}/greedy {e0['sampled']:.3f} / {e0['greedy']:.3f}" if k else f"greedy {e0['greedy']:.3f}"
    say(f"step   0/{a.steps}  val {val}  (start-up {setup_s:.0f} s, not counted)")
    recorder.mark = time.monotonic()
    trainer.train()
    result = {
        "system": system,
        "trl_version": trl.__version__,
        "steps": len(recorder.steps),
        "train_s": recorder.train_s,
        "eval_s": recorder.eval_s,
        "setup_s": setup_s,
        "process_s": time.monotonic() - t_start,
        "step_log": recorder.steps,
        "evals": recorder.evals,
        "params": params,
        "knobs": {k: v for k, v in vars(a).items() if k not in ("model", "train", "test", "out", "workdir")},
    }
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    say(f"done: {len(recorder.steps)} steps, train {recorder.train_s:.0f} s, eval {recorder.eval_s:.0f} s")
    return 0


def add_task_options(p: argparse.ArgumentParser, steps: int, eval_samples: int, eval_help: str) -> None:
    """The options both TRL sides take: the start, the task's files, the result file, steps, seed
    and the evaluation."""
    p.add_argument("--model", required=True, help="the SFT checkpoint (model and tokenizer)")
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--workdir", default=None, help="TRL's output_dir (nothing is saved there)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-samples", type=int, default=eval_samples, help=eval_help)
    p.add_argument("--seed", type=int, default=0)
