"""Model-based reward: an HF ``AutoModelForSequenceClassification`` scores (prompt, response) texts in
micro-batches, each cut from the left to ``max_length``; the score is logit 0. Imports torch."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForSequenceClassification

from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.reward.function_loader import RewardFunctionLoadError
from rlmesh.runtime.devices import default_device, default_dtype

if TYPE_CHECKING:
    from rlmesh.config import RewardModelConfig


class RewardModelScorer:
    def __init__(
        self,
        path: str,
        *,
        max_length: int | None = None,
        micro_batch_size: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        trust_remote_code: bool = False,
        override_config: dict[str, Any] | None = None,
    ) -> None:
        local = Path(path).expanduser()
        self.path = str(local) if local.exists() else path
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = dtype or default_dtype(self.device)
        self.max_length = max_length
        self.micro_batch_size = micro_batch_size
        self.tokenizer = load_tokenizer(self.path, trust_remote_code=trust_remote_code)
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.path, dtype=self.dtype, trust_remote_code=trust_remote_code, **(override_config or {})
        ).to(self.device)
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self._lock = threading.Lock()  # one forward at a time

    def format(self, prompt: str, response: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return str(self.tokenizer.apply_chat_template(chat, tokenize=False))
        return prompt + response

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """One score per (prompt, response); may be NaN/inf if the model produces them."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        texts = [self.format(p, r) for p, r in zip(prompts, responses, strict=True)]
        step = self.micro_batch_size or max(1, len(texts))
        scores: list[float] = []
        with self._lock:
            for start in range(0, len(texts), step):
                enc = self.tokenizer(
                    texts[start : start + step],
                    return_tensors="pt",
                    padding=True,
                    truncation=self.max_length is not None,
                    max_length=self.max_length,
                    # a chat template writes its own special tokens; plain text gets the tokenizer's
                    add_special_tokens=not getattr(self.tokenizer, "chat_template", None),
                ).to(self.device)
                logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
                scores.extend(logits[:, 0].float().cpu().tolist())
        return scores


def load_reward_model(rm: RewardModelConfig) -> RewardModelScorer:
    """The reward model of the ``reward_model`` section; raises ``RewardFunctionLoadError`` saying why not."""
    path = Path(rm.model.path).expanduser()
    if not path.exists():
        raise RewardFunctionLoadError(f"reward_model.model.path={rm.model.path!r}: no such directory")
    try:
        return RewardModelScorer(
            str(path),
            max_length=rm.max_length,
            micro_batch_size=rm.micro_batch_size_per_gpu,
            trust_remote_code=rm.model.trust_remote_code,
            override_config=rm.model.override_config or None,
        )
    except Exception as e:
        raise RewardFunctionLoadError(
            f"reward_model.model.path={rm.model.path!r}: cannot load a sequence-classification "
            f"model: {type(e).__name__}: {e}"
        ) from e
