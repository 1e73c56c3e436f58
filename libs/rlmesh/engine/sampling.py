"""SGLang ``sampling_params`` for the embedded engine: parsing, per-sequence sampling and the
log-probs returned with each token, as SGLang computes them. docs/internals.md#rlmeshenginesampling"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# Keys SGLang's SamplingParams accepts (shared/notes/sglang-api.md). We honour all of them except
# the penalties, which are accepted only at their neutral values.
KNOWN_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_new_tokens",
        "n",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "skip_special_tokens",
        "sampling_seed",
        "no_stop_trim",
        "spaces_between_special_tokens",
    }
)
ALL_TOKENS = 1 << 30
GREEDY_EPS = 1e-6


class SamplingParamsError(ValueError):
    """A sampling parameter the engine cannot honour; the HTTP layer answers 400 with it."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = ALL_TOKENS
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution the returned log-probs are taken under: the
        sampling temperature, or 1 for temperature 0 (greedy)."""
        return self.temperature if self.temperature >= GREEDY_EPS else 1.0


def _number(params: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingParamsError(f"sampling_params.{key}: expected a number, got {value!r}")
    if kind is int and float(value) != int(value):
        raise SamplingParamsError(f"sampling_params.{key}: expected an integer, got {value!r}")
    return kind(value)


def parse_sampling_params(params: Mapping[str, Any] | None) -> SamplingParams:
    """Validates a request's ``sampling_params`` dict; every error names the key."""
    params = dict(params or {})
    unknown = sorted(set(params) - KNOWN_KEYS)
    if unknown:
        raise SamplingParamsError(f"unknown sampling_params keys {unknown}; accepted: {sorted(KNOWN_KEYS)}")
    for key, neutral in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
        if params.get(key, neutral) not in (neutral, None):
            raise SamplingParamsError(
                f"sampling_params.{key}={params[key]!r}: the embedded engine supports only {neutral}"
            )
    sp = SamplingParams(
        max_new_tokens=_number(params, "max_new_tokens", int, 128),
        temperature=_number(params, "temperature", float, 1.0),
        top_p=_number(params, "top_p", float, 1.0),
        top_k=_number(params, "top_k", int, ALL_TOKENS),
        min_p=_number(params, "min_p", float, 0.0),
        min_new_tokens=_number(params, "min_new_tokens", int, 0),
        n=_number(params, "n", int, 1),
        sampling_seed=None
        if params.get("sampling_seed") is None
        else _number(params, "sampling_seed", int, 0),
        ignore_eos=bool(params.get("ignore_eos", False)),
        skip_special_tokens=bool(params.get("skip_special_tokens", True)),
    )
    stop = params.get("stop") or []
    sp.stop = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) for s in sp.stop):
        raise SamplingParamsError(f"sampling_params.stop: expected a string or list of strings, got {stop!r}")
    ids = params.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise SamplingParamsError(f"sampling_params.stop_token_ids: expected a list of integers, got {ids!r}")
    sp.stop_token_ids = ids
    if sp.top_k == -1 or sp.top_k == 0:
        sp.top_k = ALL_TOKENS  # SGLang maps -1 (and verl's 0/-1) to "all tokens"
    checks = [
        (sp.max_new_tokens >= 0, "max_new_tokens", sp.max_new_tokens, ">= 0"),
        (sp.temperature >= 0, "temperature", sp.temperature, ">= 0"),
        (0 < sp.top_p <= 1, "top_p", sp.top_p, "in (0, 1]"),
        (sp.top_k >= 1, "top_k", sp.top_k, ">= 1, or -1 for all"),
        (0 <= sp.min_p <= 1, "min_p", sp.min_p, "in [0, 1]"),
        (sp.min_new_tokens >= 0, "min_new_tokens", sp.min_new_tokens, ">= 0"),
        (sp.n >= 1, "n", sp.n, ">= 1"),
    ]
    for ok, key, value, allowed in checks:
        if not ok:
            raise SamplingParamsError(f"sampling_params.{key}={value!r}: must be {allowed}")
    return sp


def sampling_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The distribution ``sp`` samples from, for rows of logits ``[rows, vocab]`` sharing ``sp``:
    temperature, then top-k, then min-p, then top-p (SGLang's order)."""
    scores = logits.float() / sp.temperature
    if sp.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sp.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sp.min_p > 0:
        probs = probs.masked_fill(probs < sp.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    if sp.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_probs > sp.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Picks the next token of each row of ``logits [rows, vocab]`` under its own parameters.

    Rows with equal parameters are transformed together; each row draws its uniform number from
    its own generator (inverse-CDF sampling), so a row's tokens depend only on its seed, not on
    which other rows share the batch.
    """
    tokens = torch.argmax(logits, dim=-1)
    groups: dict[tuple, list[int]] = {}
    for r, sp in enumerate(params):
        if not sp.greedy:
            groups.setdefault((sp.temperature, sp.top_k, sp.top_p, sp.min_p), []).append(r)
    for rows in groups.values():
        probs = sampling_probs(logits[rows], params[rows[0]])
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.cat([torch.rand(1, generator=generators[r]) for r in rows])
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens[rows] = picked.clamp(max=logits.shape[-1] - 1)
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Log-probability of each row's token under ``softmax(logits / T)`` of that row, in fp32.

    .. math:: \\log p_T(y) = z_y / T - \\log \\sum_v e^{z_v / T}

    with :math:`T` = ``SamplingParams.logprob_temperature`` (1 for greedy rows). The whole
    vocabulary is the support: top-k/top-p/min-p truncation is not renormalised in, as in SGLang
    and in the learner's ``logprobs_from_logits(logits / T)``.

    Args:
        logits: ``[rows, vocab]``, the logits the token was sampled from (after any stop mask).
        tokens: ``[rows]`` the sampled tokens.
        params: each row's sampling parameters.

    Returns:
        ``[rows]`` float32 log-probs.
    """
    temperature = torch.tensor(
        [sp.logprob_temperature for sp in params], dtype=torch.float32, device=logits.device
    )
    scaled = logits.float() / temperature[:, None]
    return torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None].long())[:, 0]
