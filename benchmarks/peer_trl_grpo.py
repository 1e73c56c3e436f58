"""make bench-peer-grpo's TRL side: TRL's GRPOTrainer (the current release, in .venv-trl-grpo) on the
long-tail chain task from the SFT checkpoint benchmarks/bench_async.py built; writes one JSON result.

    .venv-trl-grpo/bin/python benchmarks/peer_trl_grpo.py --model DIR --train T.parquet --test V.parquet --out R.json

A step is one generation of ``--batch`` prompts x ``--n`` answers (transformers' ``generate`` in
the trainer's process: TRL's default without vLLM) feeding ``--mini-batches`` optimizer steps. The
reward is rlmesh's own chain rule (libs/rlmesh/reward/arithmetic.py, pure Python, loaded by path:
nothing else of rlmesh runs here). Timing as benchmarks/peer_trl.py: a step from the end of the
previous one (after its evaluation) to TRL's ``on_step_end`` of its last optimizer step; the
evaluation (avg@k, or greedy, on the test split) and the start-up are timed apart.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

T_START = time.monotonic()
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "libs"))
from peer_trl_common import (  # noqa: E402
    CPU_RUN,
    Recorder,
    add_task_options,
    load_task,
    load_tokenizer,
    say,
    train_and_record,
)

from rlmesh.reward.arithmetic import compute_score  # noqa: E402  (rlmesh's chain reward, stdlib only)


def score_chain(response_text: str, ground_truth: str) -> float:
    return float(compute_score(response_text, ground_truth)["score"])


def chain_reward(completions: list[str], ground_truth: list[str], **_: object) -> list[float]:
    """GRPOTrainer's reward function: the dataset's ``ground_truth`` column comes as a keyword."""
    return [score_chain(c, gt) for c, gt in zip(completions, ground_truth, strict=True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_task_options(p, steps=100, eval_samples=0, eval_help="0: greedy accuracy, as rlmesh's validation")
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="answers per prompt (a GRPO group)")
    p.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per generation")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay to this share of --lr")
    p.add_argument("--clip-ratio", type=float, default=0.2)
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's (verl's default)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--response-length", type=int, default=96)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = p.parse_args(argv)

    torch.set_num_threads(a.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import transformers
    import trl

    say(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
    tok = load_tokenizer(a.model)
    train, test = load_task(a.train, tok), load_task(a.test, tok)
    torch.manual_seed(a.seed)
    policy = LlamaForCausalLM.from_pretrained(a.model)
    dataset = Dataset.from_dict({"prompt": [p for p, _ in train], "ground_truth": [gt for _, gt in train]})
    completions = a.batch * a.n
    if completions % a.mini_batches:
        raise SystemExit(f"--batch x --n ({completions}) must divide into --mini-batches ({a.mini_batches})")
    args = GRPOConfig(
        output_dir=a.workdir or str(Path(a.out).parent / "trl-grpo-output"),
        # One generation of batch x n completions per step, split into mini_batches optimizer steps
        # of one micro-batch each, every completion used once (num_iterations = 1): rlmesh's GRPO
        # with ppo_epochs = 1 and ppo_mini_batch_size = batch / mini_batches.
        per_device_train_batch_size=completions // a.mini_batches,
        gradient_accumulation_steps=1,
        steps_per_generation=a.mini_batches,
        num_generations=a.n,
        num_iterations=1,
        max_steps=a.steps * a.mini_batches,
        max_completion_length=a.response_length,
        temperature=a.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,  # no KL term: rlmesh's run has none either (use_kl_loss and use_kl_in_reward off)
        epsilon=a.clip_ratio,
        loss_type="dapo",  # tokens averaged over the mini-batch: verl's loss_agg_mode token-mean
        scale_rewards="group",  # advantages over the group's std: verl's norm_adv_by_std_in_grpo
        mask_truncated_completions=False,
        learning_rate=a.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": a.min_lr_ratio},
        warmup_steps=a.warmup_ratio,  # transformers 5: a float below 1 is a share of the steps
        weight_decay=a.weight_decay,
        max_grad_norm=1.0,
        **CPU_RUN,
        log_completions=False,
        seed=a.seed,
    )
    recorder = Recorder(
        policy,
        tok,
        test,
        a,
        score_chain,
        {"reward": "reward", "length": "completions/mean_length"},
        optimizer_steps_per_step=a.mini_batches,
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[chain_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[recorder],
    )
    trainer.remove_callback(PrinterCallback)
    params = sum(x.numel() for x in policy.parameters())
    say(
        f"policy {params / 1e6:.2f}M parameters; {len(train)} train / {len(test)} test prompts; "
        f"{a.steps} steps of {a.batch} prompts x {a.n}, {a.mini_batches} mini-batches, lr {a.lr:g}"
    )
    return train_and_record(trainer, recorder, a, "trl-grpo", T_START)


if __name__ == "__main__":
    sys.exit(main())
