"""Supervised warm-up (``rlmesh sft``): teach a model the answer format before RL, on the RL
Parquet itself (prompt -> a target column + eos). docs/train.md#rlmesh-sft"""

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
from rlmesh.learner.checkpoints.hf_dir import copy_tokenizer

__all__ = [
    "DEFAULT_TARGET_KEY",
    "arithmetic_examples",
    "collate_sft",
    "greedy_accuracy",
    "main",
    "run_sft",
    "sft_examples",
    "sft_loss",
    "target_ids",
]

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
    model: torch.nn.Module,
    tokenizer: Any,
    items: Sequence[Any],
    max_new_tokens: int,
    batch_size: int = 256,
    *,
    score_fn: Callable[[str, str, Any, Any], Any] | None = None,
) -> float:
    """Mean reward of greedy responses to ``items`` (:class:`rlmesh.data.PromptItem`), scored by
    ``score_fn(data_source, solution_str, ground_truth, extra_info)`` (a float or a dict with
    ``score``; default the built-in reward of each item's data source): what validation computes,
    with plain HF generate and the response decoded without special tokens, as the reward sees it."""
    from rlmesh.reward.builtin import default_compute_score

    score_fn = score_fn or default_compute_score
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
            score = score_fn(it.data_source, text, it.ground_truth, it.extra_info)
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


# The ground truth, as verl's RL rows hold it: what ``rlmesh sft`` trains toward unless told otherwise.
DEFAULT_TARGET_KEY = "reward_model.ground_truth"
# ``--target-format`` puts the target where this placeholder is.
TARGET_PLACEHOLDER = "{target}"


def target_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` then the end-of-sequence token, as token ids (no other special tokens added): the
    target of one SFT example. The eos is appended by id, so a tokenizer that would split its eos
    token's text still ends the target with it."""
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer has no end-of-sequence token (eos_token): set one, SFT targets end with it"
        )
    return [*tokenizer.encode(text, add_special_tokens=False), int(tokenizer.eos_token_id)]


# How a dataset's messages name the settings: as this command's options ("" drops a remedy it lacks).
SETTING_NAMES = {
    "max_prompt_length": "--max-prompt-length",
    "prompt_key": "--prompt-key",
    "truncation": "",
    "filter_overlong_prompts": "",
}


def arithmetic_examples(data: str | list[str], tokenizer: Any, max_prompt_length: int = 512, max_samples: int = -1) -> tuple[list[Example], dict[str, int]]:  # fmt: skip
    """``(prompt_ids, target_ids)`` for every ``arithmetic`` row of a verl-layout Parquet, the target
    ``format_arithmetic_solution(ground_truth)`` (``#### 33``); the second value counts the rows of
    other data sources (skipped). What the demo warms up on."""
    from rlmesh.data import ARITHMETIC_DATA_SOURCE, RLHFDataset, format_arithmetic_solution

    dataset = RLHFDataset(data, tokenizer, max_prompt_length=max_prompt_length, max_samples=max_samples)
    examples, skipped = [], {}
    for item in dataset.items:
        if item.data_source != ARITHMETIC_DATA_SOURCE:
            skipped[item.data_source] = skipped.get(item.data_source, 0) + 1
            continue
        examples.append(
            (list(item.prompt_ids), target_ids(tokenizer, format_arithmetic_solution(item.ground_truth)))
        )
    return examples, skipped


def _target_text(value: Any, file: str, row: int, key: str) -> str:
    """The target of one row as text, or a DatasetError naming the file, row and key."""
    from rlmesh.data import DatasetError

    if value is None or (isinstance(value, str) and not value.strip()):
        raise DatasetError("no target (null or empty): every row needs one to train on", file=file, row=row, column=key)  # fmt: skip
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise DatasetError(f"the target is a {type(value).__name__}, not a string or a number", file=file, row=row, column=key)  # fmt: skip


def _column_values(path: str, key: str, cache: dict[str, list[Any]]) -> list[Any]:
    """Every row's value at ``key`` (``column`` or ``column.field.field``) in the file at ``path``;
    a row whose struct lacks a field holds None."""
    from rlmesh.data import DatasetError, read_parquet

    if path not in cache:
        column, *fields = key.split(".")
        table = read_parquet(path)
        if column not in table.column_names:
            raise DatasetError(
                f"no column {column!r} for the SFT target {key!r} (the file has: {', '.join(table.column_names)})",
                file=path,
                column=key,
            )
        values = table.column(column).to_pylist()
        for field in fields:
            values = [v.get(field) if isinstance(v, dict) else None for v in values]
        cache[path] = values
    return cache[path]


def sft_examples(
    data: str | list[str],
    tokenizer: Any,
    *,
    target_key: str = DEFAULT_TARGET_KEY,
    target_format: str | None = None,
    prompt_key: str = "prompt",
    max_prompt_length: int = 512,
    max_samples: int = -1,
) -> list[Example]:
    """``(prompt_ids, target_ids)`` for every row of verl-layout Parquet files.

    The prompt is rendered as the RL prompts are (:class:`rlmesh.data.RLHFDataset`: the tokenizer's
    chat template with the generation prompt, or the raw string); the target is the row's value at
    ``target_key`` (a column, or ``column.field`` into a struct such as ``extra_info.answer``) put
    into ``target_format`` at ``{target}``, then the eos token. Without ``target_format`` the
    ground truth of an ``arithmetic`` row reads ``#### <answer>`` (``format_arithmetic_solution``,
    what the demo trains) and any other target is used as it is.

    Raises:
        DatasetError: a missing column, or a row without a target (null, empty, or not a string
            or number), naming the file, the row and the key; and what ``RLHFDataset`` refuses.
    """
    from rlmesh.data import ARITHMETIC_DATA_SOURCE, RLHFDataset, format_arithmetic_solution

    if target_format is not None and TARGET_PLACEHOLDER not in target_format:
        raise ValueError(
            f"the target format {target_format!r} has no {TARGET_PLACEHOLDER} to put the target in"
        )
    dataset = RLHFDataset(
        data,
        tokenizer,
        prompt_key=prompt_key,
        max_prompt_length=max_prompt_length,
        max_samples=max_samples,
        # The target is checked below, wherever it is, with a message about SFT targets.
        require_ground_truth=False,
        setting_names=SETTING_NAMES,
    )
    columns: dict[str, list[Any]] = {}
    examples = []
    for item in dataset.items:
        text = _target_text(
            _column_values(item.file, target_key, columns)[item.row], item.file, item.row, target_key
        )
        if target_format is not None:
            text = target_format.replace(TARGET_PLACEHOLDER, text)
        elif target_key == DEFAULT_TARGET_KEY and item.data_source == ARITHMETIC_DATA_SOURCE:
            text = format_arithmetic_solution(text)
        examples.append((list(item.prompt_ids), target_ids(tokenizer, text)))
    return examples


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlmesh sft",
        description="Supervised warm-up on verl-layout Parquet: prompt -> target + eos (docs/train.md#rlmesh-sft).",
    )
    parser.add_argument("--model", required=True, help="HF model directory to start from")
    parser.add_argument("--data", required=True, nargs="+", help="verl-layout Parquet file(s)")
    parser.add_argument("--out", required=True, help="output HF directory")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory; default --model")
    parser.add_argument(
        "--target-key",
        default=DEFAULT_TARGET_KEY,
        help="the column the target is in, or column.field into a struct (e.g. extra_info.answer); "
        f"default {DEFAULT_TARGET_KEY}",
    )
    parser.add_argument(
        "--target-format",
        default=None,
        help=f"text around the target, with {TARGET_PLACEHOLDER} where it goes (e.g. '#### {TARGET_PLACEHOLDER}'); "
        "default: the target as it is ('#### <answer>' for arithmetic rows' ground truth)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="Jinja chat template file that replaces the tokenizer's own "
        "(as actor_rollout_ref.model.custom_chat_template does for RL)",
    )
    parser.add_argument("--prompt-key", default="prompt", help="the prompt column (data.prompt_key)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-length", type=int, default=512)
    parser.add_argument("--max-samples", type=int, default=-1, help="use at most this many rows; -1 = all")
    parser.add_argument("--dev", nargs="+", default=None, help="held-out Parquet scored by greedy decoding")
    parser.add_argument(
        "--reward",
        default=None,
        help="reward function that scores --dev (a file, or pkg.module:function, with verl's compute_score "
        "signature); default: the built-in reward of each row's data_source",
    )
    parser.add_argument("--eval-every", type=int, default=25, help="score --dev every this many steps")
    parser.add_argument("--stop-at", type=float, default=None, help="stop once the --dev score reaches this")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="response length when scoring --dev")
    return parser


def _dev_scorer(spec: str | None) -> Callable[[str, str, Any, Any], Any] | None:
    """The function that scores --dev samples: the user's (sync or async), or None for the built-ins."""
    if spec is None:
        return None
    import asyncio

    from rlmesh.reward.function_loader import load_reward_function

    fn = load_reward_function(spec)

    def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> Any:
        value = fn.call(data_source, solution_str, ground_truth, extra_info)
        return asyncio.run(value) if fn.is_async else value

    return score


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.stop_at is not None and not args.dev:
        parser.error("--stop-at needs --dev (the held-out split it is checked on)")
    if args.reward is not None and not args.dev:
        parser.error("--reward scores --dev: give the held-out split too")

    from rlmesh.config.actor_rollout_ref import check_chat_template
    from rlmesh.data import DatasetError, RLHFDataset
    from rlmesh.models.tokenizer import load_tokenizer
    from rlmesh.reward.function_loader import RewardFunctionLoadError

    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = Path(args.chat_template).expanduser().read_text()
            check_chat_template(chat_template)
        except (OSError, ValueError) as e:
            print(f"rlmesh sft: --chat-template {args.chat_template}: {e}", file=sys.stderr)
            return 2
    try:
        score_fn = _dev_scorer(args.reward)
    except RewardFunctionLoadError as e:
        print(f"rlmesh sft: --reward: {e}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(args.tokenizer or args.model, chat_template=chat_template)
    try:
        examples = sft_examples(
            args.data,
            tokenizer,
            target_key=args.target_key,
            target_format=args.target_format,
            prompt_key=args.prompt_key,
            max_prompt_length=args.max_prompt_length,
            max_samples=args.max_samples,
        )
        dev = (
            RLHFDataset(
                args.dev,
                tokenizer,
                prompt_key=args.prompt_key,
                max_prompt_length=args.max_prompt_length,
                setting_names=SETTING_NAMES,
            ).items
            if args.dev
            else None
        )
    except (DatasetError, ValueError) as e:
        print(f"rlmesh sft: {e}", file=sys.stderr)
        return 1
    if dev is not None and score_fn is None:
        from rlmesh.reward.builtin import builtin_for

        unknown = sorted({it.data_source for it in dev if builtin_for(it.data_source) is None})
        if unknown:
            print(
                f"rlmesh sft: no built-in reward scores the --dev rows of data_source {', '.join(map(repr, unknown))}: "
                "pass your reward function with --reward",
                file=sys.stderr,
            )
            return 2
    print(f"sft: {len(examples)} examples from {', '.join(args.data)}; target {args.target_key} + eos")
    evaluate: Callable[[torch.nn.Module], float] | None = None
    if dev is not None:

        def evaluate(model: torch.nn.Module) -> float:
            return greedy_accuracy(model, tokenizer, dev, args.max_new_tokens, score_fn=score_fn)

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
