"""Continuous batching for HF causal LMs on CPU: the embedded engine's core.

One thread owns the model. Each iteration it admits waiting sequences (one left-padded prefill
for all of them, whose KV cache is then merged into the running batch's), decodes one token for
every running sequence with the shared KV cache, and drops finished sequences from the batch at
once, so a long generation never holds a short one back and newcomers join mid-flight.

Rows of different lengths share one cache by left padding: ``mask`` marks real positions,
``positions`` holds each row's next position id, so each row computes exactly what it would
alone (up to float summation order).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from rlmesh.engine.sampling import SamplingParams, sample_token

log = logging.getLogger("rlmesh.engine")


@dataclass
class Sequence:
    request: GenerationRequest
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None


@dataclass
class GenerationRequest:
    """One /generate call: ``len(prompts) * params.n`` sequences, prompt-major."""

    rid: str
    prompts: list[list[int]]
    params: SamplingParams
    on_done: Callable[[GenerationRequest], None]
    sequences: list[Sequence] = field(default_factory=list)
    created: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None
    weight_version: str = ""
    aborted: str | None = None

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class BatchEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: set[int],
        max_batch_size: int = 64,
        decode_text: Callable[[list[int]], str] | None = None,
        weight_version: str = "default",
    ) -> None:
        self.model = model.eval()
        self.eos_token_ids = set(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.decode_text = decode_text
        self.weight_version = weight_version
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self._cond = threading.Condition()
        self._model_lock = threading.RLock()
        self._waiting: list[Sequence] = []
        self._requests: dict[str, GenerationRequest] = {}
        self._rows: list[Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._positions = torch.zeros(0, dtype=torch.long)
        self._last = torch.zeros(0, dtype=torch.long)
        self._paused = False
        self._stopping = False
        self._seed_counter = itertools.count(int(time.time_ns() % (1 << 31)))
        self.tokens_generated = 0
        self.steps = 0
        self.busy_s = 0.0  # time spent in model forwards (prefill + decode), for overhead accounting
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # ----- control, from any thread -----
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, request: GenerationRequest) -> None:
        p = request.params
        for i, (prompt, k) in enumerate(itertools.product(request.prompts, range(p.n))):
            seed = None if p.sampling_seed is None else p.sampling_seed + k
            gen = torch.Generator().manual_seed(seed if seed is not None else next(self._seed_counter))
            request.sequences.append(Sequence(request, i, list(prompt), p, gen))
        with self._cond:
            self._requests[request.rid] = request
            for seq in request.sequences:
                if p.max_new_tokens == 0:
                    seq.finish_reason = {"type": "length", "length": 0}
                else:
                    self._waiting.append(seq)
            self._cond.notify_all()
        self._complete_if_done(request)

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def abort(self, rid: str | None = None, message: str = "aborted by request") -> int:
        """Aborts one request (or all with ``rid=None``); returns how many were aborted."""
        with self._cond:
            targets = [r for r in self._requests.values() if rid is None or r.rid == rid]
            for r in targets:
                r.aborted = message
            self._cond.notify_all()
        # Waiting sequences finish now; running ones leave at the next step.
        with self._model_lock:
            self._reap_aborted()
        return len(targets)

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @contextmanager
    def exclusive(self) -> Iterator[PreTrainedModel]:
        """Holds the model between decode steps (weight updates happen here)."""
        with self._model_lock:
            yield self.model

    # ----- the engine thread -----
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stopping and (self._paused or not (self._rows or self._waiting)):
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                with self._model_lock:
                    start = time.perf_counter()
                    self._reap_aborted()
                    self._admit()
                    if self._rows:
                        self._decode()
                    self.busy_s += time.perf_counter() - start
            except Exception as e:  # never let one bad batch kill the engine thread
                log.exception("engine step failed; aborting the running batch")
                self._fail_all(f"engine error: {e}")

    def _admit(self) -> None:
        with self._cond:
            room = self.max_batch_size - len(self._rows)
            new, self._waiting = self._waiting[:room], self._waiting[room:]
        if not new:
            return
        lengths = [len(s.prompt_ids) for s in new]
        width = max(lengths)
        ids = torch.zeros(len(new), width, dtype=torch.long)
        mask = torch.zeros(len(new), width, dtype=torch.long)
        for r, s in enumerate(new):
            ids[r, width - len(s.prompt_ids) :] = torch.tensor(s.prompt_ids)
            mask[r, width - len(s.prompt_ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kw: DynamicCache(config=self.model.config)},
        )
        cache = out.past_key_values
        last_tokens = self._sample(new, out.logits[:, -1, :])
        self._merge(new, cache, mask, torch.tensor(lengths), torch.tensor(last_tokens))
        self._retire_finished()

    def _decode(self) -> None:
        ones = torch.ones(len(self._rows), 1, dtype=torch.long)
        mask = torch.cat([self._mask, ones], dim=1)
        out = self.model(
            input_ids=self._last[:, None],
            attention_mask=mask,
            position_ids=self._positions[:, None],
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        self._cache = out.past_key_values
        self._mask = mask
        self._positions = self._positions + 1
        self._last = torch.tensor(self._sample(self._rows, out.logits[:, -1, :]))
        self.steps += 1
        self._retire_finished()

    def _sample(self, rows: list[Sequence], logits: torch.Tensor) -> list[int]:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = []
        for r, seq in enumerate(rows):
            row = logits[r]
            stops = self._stop_ids(seq)
            if len(seq.output_ids) < seq.params.min_new_tokens and stops:
                row = row.clone()
                row[list(stops)] = float("-inf")
            token = sample_token(row, seq.params, seq.generator)
            seq.output_ids.append(token)
            seq.logprobs.append(float(logprobs[r, token]))
            self._check_finished(seq, token, stops)
            tokens.append(token)
        self.tokens_generated += len(rows)
        return tokens

    def _stop_ids(self, seq: Sequence) -> set[int]:
        return set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_token_ids)

    def _check_finished(self, seq: Sequence, token: int, stops: set[int]) -> None:
        if len(seq.output_ids) >= seq.params.min_new_tokens and token in stops:
            seq.finish_reason = {"type": "stop", "matched": token}
        elif seq.params.stop and self.decode_text is not None:
            text = self.decode_text(seq.output_ids[-64:])
            matched = next((s for s in seq.params.stop if text.endswith(s)), None)
            if matched is not None:
                seq.finish_reason = {"type": "stop", "matched": matched}
        if seq.finish_reason is None and len(seq.output_ids) >= seq.params.max_new_tokens:
            seq.finish_reason = {"type": "length", "length": seq.params.max_new_tokens}

    def _merge(
        self,
        new: list[Sequence],
        cache: DynamicCache,
        mask: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
    ) -> None:
        if not self._rows:
            self._rows, self._cache, self._mask, self._positions, self._last = (
                list(new),
                cache,
                mask,
                positions,
                last,
            )
            return
        assert self._cache is not None
        width = max(self._mask.shape[1], mask.shape[1])
        old_layers = _layers(self._cache)
        new_layers = _layers(cache)
        merged = [
            (
                torch.cat([_left_pad(ko, width), _left_pad(kn, width)]),
                torch.cat([_left_pad(vo, width), _left_pad(vn, width)]),
            )
            for (ko, vo), (kn, vn) in zip(old_layers, new_layers, strict=True)
        ]
        self._cache = DynamicCache(ddp_cache_data=merged, config=self.model.config)
        self._mask = torch.cat([_left_pad(self._mask, width), _left_pad(mask, width)])
        self._positions = torch.cat([self._positions, positions])
        self._last = torch.cat([self._last, last])
        self._rows += new

    def _retire_finished(self) -> None:
        keep = [i for i, s in enumerate(self._rows) if s.finish_reason is None]
        if len(keep) == len(self._rows):
            return
        finished = [s for s in self._rows if s.finish_reason is not None]
        if keep:
            index = torch.tensor(keep)
            mask = self._mask[index]
            # Drop columns no remaining row uses (left padding of departed long rows).
            first = int((mask.sum(0) > 0).float().argmax())
            layers = [(k[index, :, first:], v[index, :, first:]) for k, v in _layers(self._cache)]
            self._cache = DynamicCache(ddp_cache_data=layers, config=self.model.config)
            self._mask, self._positions, self._last = (
                mask[:, first:],
                self._positions[index],
                self._last[index],
            )
            self._rows = [self._rows[i] for i in keep]
        else:
            self._rows, self._cache = [], None
            self._mask = torch.zeros(0, 0, dtype=torch.long)
            self._positions = self._last = torch.zeros(0, dtype=torch.long)
        for request in {id(s.request): s.request for s in finished}.values():
            self._complete_if_done(request)

    def _reap_aborted(self) -> None:
        with self._cond:
            aborted = [r for r in self._requests.values() if r.aborted]
            if not aborted:
                return
            for r in aborted:
                for s in r.sequences:
                    if s.finish_reason is None:
                        s.finish_reason = {"type": "abort", "message": r.aborted}
            self._waiting = [s for s in self._waiting if s.finish_reason is None]
        self._retire_finished()
        for r in aborted:
            self._complete_if_done(r)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            for r in self._requests.values():
                r.aborted = message
        with self._model_lock:
            self._rows, self._cache = [], None
            self._mask = torch.zeros(0, 0, dtype=torch.long)
            self._positions = self._last = torch.zeros(0, dtype=torch.long)
            self._reap_aborted()

    def _complete_if_done(self, request: GenerationRequest) -> None:
        with self._cond:
            if not request.done or self._requests.pop(request.rid, None) is None:
                return
        request.finished_at = time.perf_counter()
        request.weight_version = self.weight_version
        request.on_done(request)


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pads dim 1 (mask: [B, T]) or dim 2 (cache: [B, H, T, D]) on the left with zeros to ``width``."""
    dim = 1 if t.dim() == 2 else 2
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype), t], dim=dim)
