"""Reference log-probs of each response token, in token-budgeted micro-batches, without gradients.

docs/internals.md#rlmeshreferencecompute"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rlmesh.algo import logprobs_from_logits
from rlmesh.algo.packing import attention_mask_problem, pack_units
from rlmesh.reference.token_budget import token_budget_micro_batches
from rlmesh.runtime.busy import BusyTracker
from rlmesh.runtime.devices import default_device, default_dtype
from rlmesh.runtime.invalid_request import InvalidRequestError

DEFAULT_MAX_TOKENS = 8192
DEFAULT_MAX_BATCH_SIZE = 1024


class Cancelled(RuntimeError):
    """``should_stop`` said stop between two micro-batches."""


@torch.no_grad()
def compute_ref_log_probs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS,
    max_samples_per_batch: int | None = None,
    pad_token_id: int = 0,
    temperature: float = 1.0,
    pack: bool = False,
    should_stop: Callable[[], bool] | None = None,
    on_micro_batch: Callable[[int, int], None] | None = None,
) -> list[list[float]]:
    """Per-token log-probs of each response given its prompt, one list per sample, in order.

    Every prompt needs at least one token. With ``pack``, a micro-batch holds up to
    ``max_tokens_per_batch`` real tokens and runs padding-free (:func:`_packed_forward`; the model
    must take a 4D mask, :func:`rlmesh.algo.packing.attention_mask_problem`); else right-padded.
    ``on_micro_batch(rows, tokens)`` is told about each forward (the tokens it runs, padding
    included); ``should_stop`` is asked before each and raises ``Cancelled`` when it says so.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(model.parameters()).device
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    out: list[list[float]] = [[] for _ in prompts]
    for batch in token_budget_micro_batches(
        lengths, max_tokens_per_batch, max_samples_per_batch, packed=pack
    ):
        if should_stop is not None and should_stop():
            raise Cancelled("stopped between micro-batches")
        sizes = [len(responses[i]) for i in batch]
        if pack:
            rows, labels = _packed_forward(
                model,
                [prompts[i] for i in batch],
                [responses[i] for i in batch],
                pad_token_id,
                device,
                on_micro_batch,
            )
        else:
            rows, labels = _padded_forward(
                model,
                [prompts[i] for i in batch],
                [responses[i] for i in batch],
                pad_token_id,
                device,
                on_micro_batch,
            )
        if rows is None:
            continue
        rows = rows.float()
        if temperature != 1.0:
            rows = rows / temperature
        logprobs = logprobs_from_logits(rows, labels.to(rows.device)).cpu()
        for i, chunk in zip(batch, logprobs.split(sizes), strict=True):
            out[i] = chunk.tolist()
    return out


def _padded_forward(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    device: torch.device,
    on_micro_batch: Callable[[int, int], None] | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One right-padded forward: the logits predicting every response token, samples back to back
    ``(sum(len(r)), V)``, and those tokens; None when no response has a token."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids = [*p, *r]
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    if on_micro_batch is not None:
        on_micro_batch(len(prompts), len(prompts) * width)
    logits = model(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
    ).logits
    # Only the positions that predict response tokens: row r, positions P-1 .. P+R-2.
    picked, labels = [], []
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if r:
            picked.append(logits[row, len(p) - 1 : len(p) + len(r) - 1])
            labels.append(input_ids[row, len(p) : len(p) + len(r)])
    if not picked:
        return None, input_ids.new_zeros(0)
    return torch.cat(picked), torch.cat(labels)


def _packed_forward(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    device: torch.device,
    on_micro_batch: Callable[[int, int], None] | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One padding-free forward (:func:`rlmesh.algo.packing.pack_units`): each sample its prompt
    then its response, positions from 0, attending to itself only; the same outputs as
    :func:`_padded_forward`, up to float summation order."""
    pieces = [part for p, r in zip(prompts, responses, strict=True) for part in (p, r)]
    piece_lengths = [len(x) for x in pieces]
    ids = torch.tensor([t for x in pieces for t in x], dtype=torch.long)
    positions = torch.cat([torch.arange(len(p) + len(r)) for p, r in zip(prompts, responses, strict=True)])
    packed = pack_units(
        ids, positions, piece_lengths, [[2 * k, 2 * k + 1] for k in range(len(prompts))], pad_id=pad_token_id
    )
    # Response token t of sample k is scored by the output just before it, in the same row.
    row = torch.cat([packed.row[2 * k].expand(len(r)) for k, r in enumerate(responses)])
    col = torch.cat(
        [
            packed.start[2 * k] + len(p) - 1 + torch.arange(len(r))
            for k, (p, r) in enumerate(zip(prompts, responses, strict=True))
        ]
    )
    if row.numel() == 0:
        return None, ids.new_zeros(0)
    if on_micro_batch is not None:
        on_micro_batch(len(prompts), packed.input_ids.numel())
    keep = torch.unique(col)
    logits = model(
        input_ids=packed.input_ids.to(device),
        attention_mask=packed.attention_mask.to(device),
        position_ids=packed.position_ids.to(device),
        use_cache=False,
        logits_to_keep=keep.to(device),
    ).logits
    index = torch.searchsorted(keep, col)
    return logits[row.to(device), index.to(device)], torch.tensor(
        [t for r in responses for t in r], dtype=torch.long
    )


class ReferenceModel:
    """The frozen reference policy with its limits; ``log_probs`` is safe to call from one thread
    at a time (a lock makes sure of it). ``busy`` records when its forwards run (``BusyTracker``).
    ``pack``: padding-free forwards (``actor_rollout_ref.model.use_remove_padding``, set by
    ``data.use_sequence_packing`` too); ValueError at once when the model cannot take them."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        model_path: str = "",
        max_tokens_per_batch: int = DEFAULT_MAX_TOKENS,
        max_samples_per_batch: int | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        pad_token_id: int | None = None,
        temperature: float = 1.0,
        pack: bool = False,
        busy: BusyTracker | None = None,
    ) -> None:
        config = getattr(model, "config", None)
        problem = attention_mask_problem(config) if pack else None
        if problem is not None:
            raise ValueError(
                "actor_rollout_ref.model.use_remove_padding=true (padding-free sequence packing; "
                f"data.use_sequence_packing=true sets it too) cannot run on the reference model: {problem}. "
                "Set actor_rollout_ref.model.use_remove_padding=false (and data.use_sequence_packing=false)"
            )
        self.pack = pack
        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.model_path = model_path
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)  # type: ignore[operator]
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.max_tokens_per_batch = max_tokens_per_batch
        self.max_samples_per_batch = max_samples_per_batch
        self.max_batch_size = max_batch_size
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None:
            eos = getattr(config, "eos_token_id", None)
            pad_token_id = (eos[0] if isinstance(eos, list) else eos) or 0
        self.pad_token_id = int(pad_token_id)
        self.temperature = temperature
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._lock = threading.Lock()
        self.busy = busy if busy is not None else BusyTracker()

    @classmethod
    def load(
        cls,
        path: str,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        trust_remote_code: bool = False,
        override_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> ReferenceModel:
        """An HF causal LM from ``path``: fp32 on CPU, bf16 on GPU unless ``dtype`` says otherwise."""
        from transformers import AutoModelForCausalLM

        local = Path(path).expanduser()
        source = str(local) if local.exists() else path
        target = torch.device(device) if device is not None else default_device()
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype or default_dtype(target),
            trust_remote_code=trust_remote_code,
            **(override_config or {}),
        ).to(target)
        return cls(model, model_path=source, **kwargs)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def validate(self, samples: Sequence[Any]) -> None:
        """Raises ``InvalidRequestError`` for a batch this model cannot answer. ``samples`` have
        ``uid``, ``prompt_ids`` and ``response_ids`` (``reference_pb2.LogProbsSample``)."""
        if len(samples) == 0:
            raise InvalidRequestError("empty batch: the request has no samples")
        if len(samples) > self.max_batch_size:
            raise InvalidRequestError(
                f"batch of {len(samples)} samples is over this service's max_batch_size of "
                f"{self.max_batch_size}; split it"
            )
        limit = self.max_tokens_per_batch
        if self.max_positions:
            limit = min(limit, self.max_positions)
        for i, s in enumerate(samples):
            name = f"sample {i} (uid {s.uid!r})"
            if len(s.prompt_ids) == 0:
                raise InvalidRequestError(
                    f"{name}: prompt_ids is empty (the first response token needs a prompt)"
                )
            if len(s.response_ids) == 0:
                raise InvalidRequestError(f"{name}: response_ids is empty")
            total = len(s.prompt_ids) + len(s.response_ids)
            if total > limit:
                why = (
                    f"the model's max_position_embeddings of {self.max_positions}"
                    if self.max_positions and limit == self.max_positions
                    else f"the token budget per forward of {self.max_tokens_per_batch}"
                )
                raise InvalidRequestError(
                    f"{name}: {len(s.prompt_ids)} prompt + {len(s.response_ids)} response tokens = "
                    f"{total}, over {why}"
                )
            for field in ("prompt_ids", "response_ids"):
                ids = getattr(s, field)
                low, high = min(ids), max(ids)
                if low < 0:
                    raise InvalidRequestError(f"{name}: {field} holds a negative token id {low}")
                if high >= self.vocab_size:
                    raise InvalidRequestError(
                        f"{name}: {field} holds token id {high}, not below the vocabulary size {self.vocab_size}"
                    )

    def log_probs(
        self,
        samples: Sequence[Any],
        *,
        should_stop: Callable[[], bool] | None = None,
        on_micro_batch: Callable[[int, int], None] | None = None,
    ) -> list[list[float]]:
        """Validated log-probs, one list per sample (blocking: run it in a thread from asyncio)."""
        self.validate(samples)
        with self._lock, self.busy.busy():
            return compute_ref_log_probs(
                self.model,
                [list(s.prompt_ids) for s in samples],
                [list(s.response_ids) for s in samples],
                max_tokens_per_batch=self.max_tokens_per_batch,
                max_samples_per_batch=self.max_samples_per_batch,
                pad_token_id=self.pad_token_id,
                temperature=self.temperature,
                pack=self.pack,
                should_stop=should_stop,
                on_micro_batch=on_micro_batch,
            )
