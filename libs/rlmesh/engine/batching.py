"""Continuous batching for HF causal LMs on CPU, the embedded engine's core: one thread owns the
model and admits, decodes and drops sequences every step. docs/internals.md#rlmeshenginebatching"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from rlmesh.engine.runner import make_runner
from rlmesh.engine.sampling import SamplingParams, sample_tokens, token_logprobs
from rlmesh.runtime.busy import BusyTracker

log = logging.getLogger("rlmesh.engine")


class DuplicateRequestError(ValueError):
    """A request reuses the rid of one still running."""


@dataclass
class Sequence:
    request: GenerationRequest
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # The weight version each output token was sampled with: weights pushed between decode steps
    # (pause in place, update, continue) change it within a sequence.
    versions: list[str] = field(default_factory=list)
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
        self.runner = make_runner(self.model)
        self._cond = threading.Condition()
        self._model_lock = threading.RLock()
        self._waiting: list[Sequence] = []
        self._requests: dict[str, GenerationRequest] = {}
        self._rows: list[Sequence] = []
        self._last = torch.zeros(0, dtype=torch.long)
        self._paused = False
        self._held = False
        self._stopping = False
        self._seed_counter = itertools.count(int(time.time_ns() % (1 << 31)))
        self.tokens_generated = 0
        self.steps = 0
        self.busy = BusyTracker()  # when the model computes (prefill, decode, sampling)
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
        """Queues a request; raises ``DuplicateRequestError`` while one with its rid is running
        (it would replace that one, which then never completes)."""
        with self._cond:
            if request.rid in self._requests:
                raise DuplicateRequestError(f"rid {request.rid!r} is already running; use another rid")
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

    def hold(self, on: bool) -> None:
        """Holds generation (or lets it go on) regardless of pause/resume: while the weights are
        half written by a failed update, nothing may be generated with them."""
        with self._cond:
            self._held = on
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
    def busy_s(self) -> float:
        return self.busy.busy_s

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
                while not self._stopping and (
                    self._paused or self._held or not (self._rows or self._waiting)
                ):
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                with self._model_lock, self.busy.busy():
                    self._reap_aborted()
                    self._admit()
                    if self._rows:
                        self._decode()
                    self._reap_aborted()  # the requests that failed in this step leave now
            except Exception as e:  # never let one bad step kill the engine thread
                # A failure that no single request explains (the decode forward of every row).
                log.exception("engine step failed; aborting the running batch")
                self._fail_all(f"engine error: {e}")

    def _admit(self) -> None:
        with self._cond:
            room = self.max_batch_size - len(self._rows)
            new, self._waiting = self._waiting[:room], self._waiting[room:]
        if not new:
            return
        # Rows with the same prompt (a request's n samples, or equal prompts across requests) share
        # one prefill.
        by_prompt: dict[tuple[int, ...], list[Sequence]] = {}
        for seq in new:
            by_prompt.setdefault(tuple(seq.prompt_ids), []).append(seq)
        groups = list(by_prompt.values())
        try:
            self._prefill(groups)
        except Exception as e:
            if len(groups) == 1:
                self._fail_requests(groups[0], e)
                return
            # A prefill changes the runner only when it succeeds, so each prompt can be tried
            # alone: only the requests whose own prompt fails are aborted.
            log.warning("prefill of %d prompts failed (%s); admitting them one by one", len(groups), e)
            for group in groups:
                try:
                    self._prefill([group])
                except Exception as alone:
                    self._fail_requests(group, alone)

    def _prefill(self, groups: list[list[Sequence]]) -> None:
        logits = self.runner.prefill([list(g[0].prompt_ids) for g in groups], [len(g) for g in groups])
        new = [seq for group in groups for seq in group]
        self._rows += new
        self._last = torch.cat([self._last, self._sample(new, logits)])
        self._retire_finished()

    def _fail_requests(self, sequences: list[Sequence], error: Exception) -> None:
        """Marks the requests these sequences belong to aborted (their other sequences too: a
        response is all of its samples or none); they leave at the end of the step, the rest of
        the batch goes on."""
        log.error("engine failed on request(s) %s: %s", sorted({s.request.rid for s in sequences}), error)
        with self._cond:
            for seq in sequences:
                seq.request.aborted = f"engine error on this request: {error}"

    def _decode(self) -> None:
        logits = self.runner.decode(self._last)
        self._last = self._sample(self._rows, logits)
        self.steps += 1
        self._retire_finished()

    def _sample(self, rows: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Picks each row's next token; records it and its log-prob under the row's temperature
        (:func:`~rlmesh.engine.sampling.token_logprobs`); marks finished rows."""
        stops = [self._stop_ids(seq) for seq in rows]
        early = [
            r for r, seq in enumerate(rows) if len(seq.output_ids) < seq.params.min_new_tokens and stops[r]
        ]
        if early:
            logits = logits.clone()
            for r in early:
                logits[r, list(stops[r])] = float("-inf")
        try:
            tokens = sample_tokens(logits, [seq.params for seq in rows], [seq.generator for seq in rows])
            logprobs = token_logprobs(logits, tokens, [seq.params for seq in rows]).tolist()
        except Exception:  # one row's parameters may be at fault: sample row by row
            tokens, logprobs = self._sample_rows(rows, logits)
        for seq, token, logprob, stop in zip(rows, tokens.tolist(), logprobs, stops, strict=True):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.weight_version)
            try:
                self._check_finished(seq, token, stop)
            except Exception as e:  # e.g. a stop string the tokenizer cannot decode against
                self._fail_requests([seq], e)
        self.tokens_generated += len(rows)
        return tokens

    def _sample_rows(self, rows: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        tokens, logprobs = [], []
        for r, seq in enumerate(rows):
            try:
                t = sample_tokens(logits[r : r + 1], [seq.params], [seq.generator])
                lp = token_logprobs(logits[r : r + 1], t, [seq.params])
                tokens.append(int(t[0]))
                logprobs.append(float(lp[0]))
            except Exception as e:
                self._fail_requests([seq], e)
                tokens.append(0)
                logprobs.append(0.0)
        return torch.tensor(tokens, dtype=torch.long), logprobs

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

    def _retire_finished(self) -> None:
        keep = [i for i, s in enumerate(self._rows) if s.finish_reason is None]
        if len(keep) == len(self._rows):
            return
        finished = [s for s in self._rows if s.finish_reason is not None]
        order = self.runner.retire(keep)
        self._rows = [self._rows[i] for i in order]
        self._last = self._last[torch.tensor(order, dtype=torch.long)]
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
            self._rows = []
            self.runner.reset()
            self._last = torch.zeros(0, dtype=torch.long)
            self._reap_aborted()

    def _complete_if_done(self, request: GenerationRequest) -> None:
        with self._cond:
            if not request.done or self._requests.pop(request.rid, None) is None:
                return
        request.finished_at = time.perf_counter()
        request.weight_version = self.weight_version
        request.on_done(request)
