"""make bench-peer's TRL side: TRL 1.12's single-process PPOTrainer on the benchmark's task, from the
SFT checkpoint benchmarks/bench_peer.py built. Runs in .venv-trl (torch, transformers, trl, pyarrow:
nothing of rlmesh), writes one JSON result file.

    .venv-trl/bin/python benchmarks/peer_trl.py --model DIR --train T.parquet --test V.parquet --out R.json

Timing: ``train_s`` of a step runs from the end of the previous one (after its evaluation) to TRL's
``on_step_end``: generation, reference and value forwards, reward, GAE and every PPO update.
Evaluation on the test set (greedy, and avg@k: ``--eval-samples`` sampled answers per prompt;
before training, every ``--eval-every`` steps and after the last) is timed apart (``eval_s``) and
not counted; neither is the start-up (imports, loading the models).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

T_START = time.monotonic()
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # "trl.experimental is unstable"
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5 renames gradient_checkpointing

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    TrainerCallback,
)
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_reward import score_answer  # noqa: E402  (the rule rlmesh scores with too)

# TRL treats every pad id as padding and finds a response's end at its first pad, so pad must not
# be eos (rlmesh's char tokenizer pads with eos); <|unk|> is a special token the SFT never emits.
TRL_PAD_TOKEN = "<|unk|>"


def say(msg: str) -> None:
    print(f"[trl] {msg}", flush=True)


def load_task(path: str) -> list[tuple[str, str]]:
    """(prompt, ground truth) per row of a verl-layout Parquet file with raw-string prompts."""
    table = pq.read_table(path, columns=["prompt", "reward_model"]).to_pylist()
    return [(row["prompt"], str(row["reward_model"]["ground_truth"])) for row in table]


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tok.pad_token = TRL_PAD_TOKEN
    tok.padding_side = "left"  # TRL: response = query_response[:, padded query width:]
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        raise SystemExit(f"the tokenizer in {model_dir} has no {TRL_PAD_TOKEN} distinct from eos")
    return tok


class _RuleScorer(nn.Module):
    """Stands in for the backbone ``trl.experimental.utils.get_reward`` calls: ``hidden_states[-1]``
    is already the per-sequence score broadcast over the tokens, and ``score`` is the identity."""

    def __init__(self, tok: PreTrainedTokenizerFast, answers: dict[str, str]) -> None:
        super().__init__()
        self.tok, self.answers = tok, answers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: object) -> SimpleNamespace:
        scores = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            text = self.tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=True)
            prompt, _, response = text.partition("=")
            scores.append(score_answer(response, self.answers[prompt + "="]))
        s = torch.tensor(scores, device=input_ids.device)
        return SimpleNamespace(hidden_states=(s[:, None, None].expand(-1, input_ids.shape[1], 1),))


class RuleReward(nn.Module):
    base_model_prefix = "backbone"  # get_reward does getattr(model, model.base_model_prefix)

    def __init__(self, tok: PreTrainedTokenizerFast, answers: dict[str, str]) -> None:
        super().__init__()
        self.backbone = _RuleScorer(tok, answers)
        self.score = nn.Identity()


@torch.no_grad()
def accuracy(
    policy: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    task: list[tuple[str, str]],
    max_new_tokens: int,
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
            enc = tok([p for p, _ in chunk], return_tensors="pt", padding=True)
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            out = policy.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
                **(sampling if samples else {"do_sample": False}),
            )
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(score_answer(t, gt) for t, (_, gt) in zip(texts, chunk, strict=True))
    policy.train(was_training)
    return correct / len(rows)


class Recorder(TrainerCallback):
    """Per-step training time, the step's logged metrics, and greedy accuracy every ``eval_every``
    steps, the evaluation timed apart."""

    def __init__(self, policy, tok, test, a: argparse.Namespace) -> None:
        self.policy, self.tok, self.test, self.a = policy, tok, test, a
        self.total, self.eval_every = a.steps, a.eval_every
        self.steps: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self.eval_s = 0.0
        self.train_s = 0.0
        self.last_log: dict[str, float] = {}
        self.mark = time.monotonic()

    def evaluate(self, step: int) -> dict[str, float]:
        t0 = time.monotonic()
        a = self.a
        greedy = accuracy(self.policy, self.tok, self.test, a.response_length)
        sampled = accuracy(
            self.policy,
            self.tok,
            self.test,
            a.response_length,
            samples=a.eval_samples,
            temperature=a.temperature,
            seed=a.seed * 100_003 + step,
        )
        took = time.monotonic() - t0
        self.eval_s += took
        e = {"step": step, "greedy": greedy, "sampled": sampled, "train_s": self.train_s, "eval_s": took}
        self.evals.append(e)
        return e

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.last_log = dict(logs or {})

    def on_step_end(self, args, state, control, **kwargs):
        took = time.monotonic() - self.mark
        self.train_s += took
        step = state.global_step
        m = self.last_log
        self.steps.append(
            {"step": step, "train_s": took, "score": m.get("objective/scores"), "kl": m.get("objective/kl")}
        )
        val = "   -  /   -  "
        if step % self.eval_every == 0 or step == self.total:
            e = self.evaluate(step)
            val = f"{e['sampled']:.3f} / {e['greedy']:.3f}"
        eta = self.train_s / step * (self.total - step)
        say(
            f"step {step:>3}/{self.total}  reward {m.get('objective/scores', 0):.3f}  "
            f"kl {m.get('objective/kl', 0):+.4f}  val avg@{self.a.eval_samples}/greedy {val}  {took:.2f} s/step  "
            f"[train {self.train_s:.0f} s, eta {eta:.0f} s]"
        )
        self.mark = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the SFT checkpoint (model and tokenizer)")
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--workdir", default=None, help="TRL's output_dir (nothing is saved there)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-samples", type=int, default=8, help="sampled answers per test prompt (avg@k)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64, help="prompts per PPO step (n = 1)")
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--ppo-epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument("--cliprange", type=float, default=0.2)
    p.add_argument("--cliprange-value", type=float, default=0.2)
    p.add_argument("--vf-coef", type=float, default=0.1)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--response-length", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = p.parse_args(argv)

    torch.set_num_threads(a.threads)
    hf_logging.set_verbosity_error()  # the "newly initialized" score head, generate()'s deprecation line
    hf_logging.disable_progress_bar()  # "Loading weights" bars
    import transformers
    import trl

    say(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
    tok = load_tokenizer(a.model)
    train, test = load_task(a.train), load_task(a.test)
    answers = dict(train)
    torch.manual_seed(a.seed)
    policy = LlamaForCausalLM.from_pretrained(a.model)
    ref = LlamaForCausalLM.from_pretrained(a.model)
    value = LlamaForSequenceClassification.from_pretrained(a.model, num_labels=1)  # fresh score head
    dataset = Dataset.from_dict({"input_ids": [tok(prompt)["input_ids"] for prompt, _ in train]})
    args = PPOConfig(
        output_dir=a.workdir or str(Path(a.out).parent / "trl-output"),
        # GA = 1: local_batch_size = per_device * GA = prompts per step, and each of the
        # num_mini_batches mini-batches is one micro-batch and one optimizer step.
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=1,
        num_mini_batches=a.mini_batches,
        num_ppo_epochs=a.ppo_epochs,
        total_episodes=a.batch * a.steps,
        local_rollout_forward_batch_size=a.batch,
        response_length=a.response_length,
        stop_token="eos",
        temperature=a.temperature,
        missing_eos_penalty=None,
        kl_coef=a.kl_coef,
        kl_estimator="k1",
        cliprange=a.cliprange,
        cliprange_value=a.cliprange_value,
        vf_coef=a.vf_coef,
        gamma=a.gamma,
        lam=a.lam,
        whiten_rewards=False,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        num_sample_generations=0,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=a.seed,
    )
    recorder = Recorder(policy, tok, test, a)
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=RuleReward(tok, answers),
        train_dataset=dataset,
        value_model=value,
        callbacks=[recorder],
    )
    trainer.remove_callback(PrinterCallback)  # a dict of metrics per step; the recorder prints a line
    params = sum(x.numel() for x in policy.parameters())
    say(
        f"policy {params / 1e6:.2f}M parameters; {len(train)} train / {len(test)} test prompts; "
        f"{a.steps} steps of {a.batch} prompts, {a.ppo_epochs} epochs x {a.mini_batches} mini-batches, "
        f"lr {a.lr:g}, kl_coef {a.kl_coef:g}"
    )
    e0 = recorder.evaluate(0)
    setup_s = time.monotonic() - T_START - recorder.eval_s
    say(
        f"step   0/{a.steps}  val avg@{a.eval_samples}/greedy {e0['sampled']:.3f} / {e0['greedy']:.3f}  "
        f"(start-up {setup_s:.0f} s, not counted)"
    )
    recorder.mark = time.monotonic()
    trainer.train()
    result = {
        "system": "trl",
        "trl_version": trl.__version__,
        "steps": len(recorder.steps),
        "train_s": recorder.train_s,
        "eval_s": recorder.eval_s,
        "setup_s": setup_s,
        "process_s": time.monotonic() - T_START,
        "step_log": recorder.steps,
        "evals": recorder.evals,
        "params": params,
        "knobs": {k: v for k, v in vars(a).items() if k not in ("model", "train", "test", "out", "workdir")},
    }
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    say(f"done: {len(recorder.steps)} steps, train {recorder.train_s:.0f} s, eval {recorder.eval_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
