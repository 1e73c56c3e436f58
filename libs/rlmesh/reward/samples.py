"""Reading a batch of ``RewardSample``: checks on the batch, and each sample's texts and extra_info."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlmesh.runtime.invalid_request import InvalidRequestError
from rlmesh.v1 import reward_pb2

log = logging.getLogger("rlmesh.reward")


def validate_batch(
    samples: Sequence[reward_pb2.RewardSample], max_batch_size: int, vocab_size: int | None
) -> None:
    """Raises ``InvalidRequestError`` naming what is wrong with the batch."""
    if len(samples) == 0:
        raise InvalidRequestError("empty batch: the request has no samples to score")
    if len(samples) > max_batch_size:
        raise InvalidRequestError(
            f"batch of {len(samples)} samples is over this service's max_batch_size of "
            f"{max_batch_size}; split it"
        )
    for i, sample in enumerate(samples):
        for field in ("prompt_ids", "response_ids"):
            ids = getattr(sample, field)
            if not ids:
                continue
            low, high = min(ids), max(ids)
            if low < 0:
                raise InvalidRequestError(
                    f"sample {i} (uid {sample.uid!r}): {field} holds a negative token id {low}"
                )
            if vocab_size is not None and high >= vocab_size:
                raise InvalidRequestError(
                    f"sample {i} (uid {sample.uid!r}): {field} holds token id {high}, not below the "
                    f"vocabulary size {vocab_size}"
                )


def sample_inputs(sample: reward_pb2.RewardSample, tokenizer: Any) -> tuple[str, Any]:
    """(solution_str, extra_info); raises ValueError for a sample that cannot be scored."""
    extra_info: Any = {}
    if sample.extra_info_json:
        try:
            extra_info = json.loads(sample.extra_info_json)
        except json.JSONDecodeError as e:
            raise ValueError(f"extra_info_json is not valid JSON: {e}") from None
    solution = sample.response_text
    # Present (even empty) is the policy's own decoding: a response of special tokens only is "".
    if not sample.HasField("response_text") and len(sample.response_ids) > 0:
        if tokenizer is None:
            raise ValueError(
                f"response_text is not set but response_ids holds {len(sample.response_ids)} ids, and "
                "this reward service has no tokenizer to decode them"
            )
        solution = tokenizer.decode(list(sample.response_ids), skip_special_tokens=True)
    return solution, extra_info


def prompt_text(sample: reward_pb2.RewardSample, tokenizer: Any) -> str:
    """``prompt_text``, else the decoded ``prompt_ids`` when there is a tokenizer, else empty."""
    if not sample.prompt_text and len(sample.prompt_ids) > 0 and tokenizer is not None:
        return str(tokenizer.decode(list(sample.prompt_ids), skip_special_tokens=True))
    return sample.prompt_text


def policy_tokenizer(path: str) -> Any:
    """The policy tokenizer when ``path`` is a local directory with one, else None (no hub lookups)."""
    local = Path(path).expanduser()
    if not local.is_dir() or not any(
        (local / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    try:
        from rlmesh.models.tokenizer import load_tokenizer

        return load_tokenizer(str(local))
    except Exception as e:
        log.warning("could not load the tokenizer at %s (%s); token ids are not checked", local, e)
        return None
