"""Supervised warm-up (``rlmesh sft``): teach a model the answer format before RL.

docs/train.md#rlmesh-sft"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rlmesh.algo import logprobs_from_logits
from rlmesh.learner.hf_dir import copy_tokenizer

__all__ = ["collate_sft", "greedy_accuracy", "main", "run_sft", "sft_loss"]

Example = tuple[Sequence[int], Sequence[int]]


def collate_sft(examples: Sequence[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + target`` rows with a loss mask on the target tokens.

    Returns ``input_ids``, ``attention_mask``, ``position_ids`` ``(n, L)`` and ``loss_mask``
    ``(n, L - 1)``: ``loss_mask[i, t]`` is 1 when token ``t + 1`` is a target token (the logit
    at ``t`` predicts it).
    """
    width = max(len(p) + len(t) for p, t in examples)
    n = len(examples)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    target = torch.zeros((n, width), dtype=torch.long)
    for i, (prompt, answer) in enumerate(examples):
        ids = [*prompt, *answer]
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, : len(ids)] = 1
        target[i, len(prompt) : len(ids)] = 1
    position_ids = torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "loss_mask": target[:, 1:],
    }


def sft_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Mean negative log-likelihood of the target tokens.

    .. math:: \\mathcal{L} = -\\frac{\\sum_{i,t} m_{i,t} \\log p(x_{i,t+1} | x_{i,\\le t})}{\\sum m}

    Returns:
        the loss and the number of target tokens.
    """
    logits = (
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        )
        .logits[:, :-1]
        .float()
    )
    log_probs = logprobs_from_logits(logits, batch["input_ids"][:, 1:])
    mask = batch["loss_mask"]
    tokens = int(mask.sum())
    return -(log_probs * mask).sum() / max(tokens, 1), tokens


def greedy_accuracy(
    model: torch.nn.Module, tokenizer: Any, items: Sequence[Any], max_new_tokens: int, batch_size: int = 256
) -> float:
    """Mean reward of greedy responses to ``items`` (:class:`rlmesh.data.PromptItem`), scored by the
    built-in reward of each item's data source: what validation computes, with plain HF generate."""
    from rlmesh.reward.builtin import default_compute_score

    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    total = 0.0
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        width = max(len(it.prompt_ids) for it in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, it in enumerate(chunk):  # left padding: every row's response starts at `width`
            ids[i, width - len(it.prompt_ids) :] = torch.tensor(it.prompt_ids)
            mask[i, width - len(it.prompt_ids) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        for text, it in zip(texts, chunk, strict=True):
            score = default_compute_score(it.data_source, text, it.ground_truth, it.extra_info)
            total += float(score["score"] if isinstance(score, dict) else score)
    model.train(was_training)
    return total / max(len(items), 1)


def run_sft(
    model_path: str,
    out_dir: str,
    examples: list[tuple[list[int], list[int]]],
    epochs: int = 3,
    lr: float = 1e-4,
    batch_size: int = 16,
    seed: int = 0,
    *,
    tokenizer_path: str | None = None,
    log_fn: Any = print,
    evaluate: Callable[[torch.nn.Module], float] | None = None,
    eval_every: int = 0,
    stop_at: float | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
) -> dict[str, Any]:
    """Fine-tune ``model_path`` on ``(prompt_ids, target_ids)`` pairs and save it to ``out_dir``.

    AdamW (no weight decay, ``betas``), examples shuffled each epoch by ``seed``, loss on target tokens only;
    one line per epoch through ``log_fn``. With ``evaluate`` (a held-out score of the model) and
    ``eval_every`` > 0 it scores the model every that many optimizer steps and once at the end;
    with ``stop_at`` it stops at the first score >= ``stop_at`` (``epochs`` is then a cap).

    Returns:
        ``{"epoch_losses": [...], "initial_loss": x, "final_loss": y, "steps": n, "evals":
        [[step, score], ...], "dev_score": last score or None, "reached": bool}`` where
        ``initial_loss`` is the mean loss over all examples before training and ``final_loss``
        after it (no grad, same batches); ``reached`` tells whether ``stop_at`` was reached.
    """
    if not examples:
        raise ValueError("run_sft needs at least one example")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(model_path), dtype=torch.float32)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=betas)

    def batches(order: list[int]) -> list[dict[str, torch.Tensor]]:
        return [
            collate_sft([examples[i] for i in order[s : s + batch_size]], pad)
            for s in range(0, len(order), batch_size)
        ]

    def mean_loss() -> float:
        model.eval()
        total = count = 0.0
        with torch.no_grad():
            for batch in batches(list(range(len(examples)))):
                loss, tokens = sft_loss(model, batch)
                total += loss.item() * tokens
                count += tokens
        return total / max(count, 1.0)

    evals: list[list[float]] = []

    def score_dev() -> bool:
        """Scores the model on the dev split; True when it reached ``stop_at``."""
        assert evaluate is not None
        evals.append([steps, evaluate(model)])
        reached = stop_at is not None and evals[-1][1] >= stop_at
        if reached:
            log_fn(f"sft step {steps}: dev score {evals[-1][1]:.3f} reached {stop_at}")
        return reached

    initial = mean_loss()
    log_fn(f"sft: {len(examples)} examples, {epochs} epochs, batch {batch_size}, lr {lr}; loss {initial:.4f}")
    epoch_losses, steps, reached = [], 0, False
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        order = list(range(len(examples)))
        rng.shuffle(order)
        model.train()
        total = count = 0.0
        for batch in batches(order):
            loss, tokens = sft_loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * tokens
            count += tokens
            steps += 1
            if evaluate is not None and eval_every > 0 and steps % eval_every == 0:
                reached = score_dev()
                if reached:
                    break
        epoch_losses.append(total / max(count, 1.0))
        dev = f", dev score {evals[-1][1]:.3f}" if evals else ""
        log_fn(
            f"sft epoch {epoch}/{epochs}: loss {epoch_losses[-1]:.4f}{dev} ({time.perf_counter() - start:.1f} s)"
        )
        if reached:
            break
    if evaluate is not None and (not evals or evals[-1][0] != steps):
        reached = score_dev()
    final = mean_loss()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    copy_tokenizer(tokenizer_path or model_path, out)
    log_fn(f"sft: loss {initial:.4f} -> {final:.4f}; saved {out}")
    return {
        "epoch_losses": epoch_losses,
        "initial_loss": initial,
        "final_loss": final,
        "steps": steps,
        "evals": evals,
        "dev_score": evals[-1][1] if evals else None,
        "reached": reached,
    }


def arithmetic_examples(data: str | list[str], tokenizer: Any, max_prompt_length: int = 512, max_samples: int = -1) -> tuple[list[tuple[list[int], list[int]]], dict[str, int]]:  # fmt: skip
    """``(prompt_ids, target_ids)`` for every ``arithmetic`` row of a verl-layout Parquet; the
    second value counts the rows of other data sources (skipped: no target format for them)."""
    from rlmesh.data import ARITHMETIC_DATA_SOURCE, RLHFDataset, format_arithmetic_solution

    dataset = RLHFDataset(data, tokenizer, max_prompt_length=max_prompt_length, max_samples=max_samples)
    examples, skipped = [], {}
    for item in dataset.items:
        if item.data_source != ARITHMETIC_DATA_SOURCE:
            skipped[item.data_source] = skipped.get(item.data_source, 0) + 1
            continue
        text = format_arithmetic_solution(item.ground_truth) + tokenizer.eos_token
        examples.append((list(item.prompt_ids), tokenizer.encode(text, add_special_tokens=False)))
    return examples, skipped


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlmesh sft", description="Supervised warm-up on the arithmetic task."
    )
    parser.add_argument("--model", required=True, help="HF model directory to start from")
    parser.add_argument("--data", required=True, nargs="+", help="verl-layout Parquet file(s)")
    parser.add_argument("--out", required=True, help="output HF directory")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory; default --model")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-length", type=int, default=512)
    parser.add_argument("--max-samples", type=int, default=-1, help="use at most this many rows; -1 = all")
    parser.add_argument("--dev", nargs="+", default=None, help="held-out Parquet scored by greedy decoding")
    parser.add_argument("--eval-every", type=int, default=25, help="score --dev every this many steps")
    parser.add_argument("--stop-at", type=float, default=None, help="stop once the --dev score reaches this")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="response length when scoring --dev")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.stop_at is not None and not args.dev:
        parser.error("--stop-at needs --dev (the held-out split it is checked on)")

    from transformers import AutoTokenizer

    from rlmesh.data import DatasetError

    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(args.tokenizer or args.model))
    try:
        examples, skipped = arithmetic_examples(
            args.data, tokenizer, args.max_prompt_length, args.max_samples
        )
    except DatasetError as e:
        print(f"rlmesh sft: {e}", file=sys.stderr)
        return 1
    for source, count in sorted(skipped.items()):
        print(f"sft: skipped {count} rows of data_source {source!r} (only 'arithmetic' has a target format)")
    if not examples:
        print("rlmesh sft: no arithmetic rows in the data", file=sys.stderr)
        return 1
    evaluate = None
    if args.dev:
        from rlmesh.data import RLHFDataset

        dev = RLHFDataset(args.dev, tokenizer, max_prompt_length=args.max_prompt_length).items
        evaluate = lambda model: greedy_accuracy(model, tokenizer, dev, args.max_new_tokens)  # noqa: E731
    result = run_sft(
        args.model,
        args.out,
        examples,
        epochs=args.epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        tokenizer_path=args.tokenizer,
        evaluate=evaluate,
        eval_every=args.eval_every,
        stop_at=args.stop_at,
    )
    if args.stop_at is not None and not result["reached"]:
        print(
            f"rlmesh sft: the dev score reached {result['dev_score']:.3f}, not {args.stop_at}, "
            f"within {args.epochs} epochs",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
