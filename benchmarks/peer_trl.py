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

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_reward import score_answer  # noqa: E402  (the rule rlmesh scores with too)
from peer_trl_common import (  # noqa: E402
    CPU_RUN,
    Recorder,
    add_task_options,
    load_task,
    load_tokenizer,
    say,
    train_and_record,
)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_task_options(p, steps=100, eval_samples=8, eval_help="sampled answers per test prompt (avg@k)")
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
    train, test = load_task(a.train, tok), load_task(a.test, tok)
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
        **CPU_RUN,
        seed=a.seed,
    )
    recorder = Recorder(
        policy, tok, test, a, score_answer, {"reward": "objective/scores", "kl": "objective/kl"}
    )
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
    return train_and_record(trainer, recorder, a, "trl", T_START)


if __name__ == "__main__":
    sys.exit(main())
