"""The simulated engine model: no network, token ids at a set per-sequence rate and length
distribution, and real weight buffers of a set size, so that a fleet of engines can run on one
machine and the weight-push path still moves real bytes. docs/scale.md#the-simulated-engine"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

SIMULATED_MODEL_TYPE = "rlmesh_simulated"
NEVER = -1e9  # a logit whose token is not sampled (exp underflows to 0 against a 0 logit)


class SimulationSpecError(ValueError):
    """A simulated engine's spec names a key it does not know or holds a value out of range."""


@dataclass(frozen=True)
class SimulationSpec:
    """What a simulated engine does. A response's length is drawn from a log-normal with median
    ``length_median`` and shape ``length_sigma``, clipped to [1, ``length_max``]; every running
    sequence gains ``tokens_per_s`` tokens a second (a decode step takes ``1 / tokens_per_s``
    seconds whatever the batch, as a memory-bound GPU decode does); a prompt's prefill takes its
    length over ``prefill_tokens_per_s`` (0: no time). The weights are ``weight_bytes`` of
    ``weight_dtype`` in tensors of at most ``tensor_bytes``, named ``w0``, ``w1``, ... ``seed`` fixes
    the lengths drawn; None (the default) draws each engine's from the OS, so that engines sharing
    one model directory do not all produce the same lengths."""

    vocab_size: int = 1024
    eos_token_id: int = 0
    tokens_per_s: float = 50.0
    prefill_tokens_per_s: float = 0.0
    length_median: int = 256
    length_sigma: float = 0.6
    length_max: int = 4096
    weight_bytes: int = 1 << 20
    weight_dtype: str = "bfloat16"
    tensor_bytes: int = 64 << 20
    context: int = 1 << 16
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = [
            f"{f.name} {f.type} (got {type(v).__name__} {v!r})"
            for f in fields(self)
            if not _of_type(v := getattr(self, f.name), f.type)
        ]
        if problems:
            raise SimulationSpecError("simulated engine: need " + "; ".join(problems))
        if self.vocab_size < 2 or not 0 <= self.eos_token_id < self.vocab_size:
            problems.append(
                f"vocab_size >= 2 with eos_token_id in it (got {self.vocab_size}, {self.eos_token_id})"
            )
        if not self.tokens_per_s > 0 or self.prefill_tokens_per_s < 0:
            problems.append(
                f"tokens_per_s > 0 and prefill_tokens_per_s >= 0 (got {self.tokens_per_s}, {self.prefill_tokens_per_s})"
            )
        if not 1 <= self.length_median <= self.length_max or self.length_sigma < 0:
            problems.append(
                f"1 <= length_median <= length_max and length_sigma >= 0 "
                f"(got {self.length_median}, {self.length_max}, {self.length_sigma})"
            )
        if self.weight_bytes < 0 or self.tensor_bytes < 1:
            problems.append(
                f"weight_bytes >= 0 and tensor_bytes >= 1 (got {self.weight_bytes}, {self.tensor_bytes})"
            )
        if not isinstance(getattr(torch, self.weight_dtype, None), torch.dtype):
            problems.append(f"weight_dtype a torch dtype (got {self.weight_dtype!r})")
        if problems:
            raise SimulationSpecError("simulated engine: need " + "; ".join(problems))

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.weight_dtype)

    def tensor_shapes(self) -> list[tuple[str, int]]:
        """(name, elements) of each weight tensor: ``weight_bytes`` split into ``tensor_bytes`` pieces."""
        item = self.dtype.itemsize
        total, per = self.weight_bytes // item, max(1, self.tensor_bytes // item)
        return [(f"w{i}", min(per, total - start)) for i, start in enumerate(range(0, total, per))]


def _of_type(value: object, annotation: str) -> bool:
    """Whether ``value`` fits a ``SimulationSpec`` field's annotation (bool is no int here)."""
    if value is None:
        return "None" in annotation
    if isinstance(value, bool):
        return False
    if annotation.startswith("int"):
        return isinstance(value, int)
    if annotation == "float":
        return isinstance(value, int | float)
    return isinstance(value, str)


def simulation_spec(
    entries: dict[str, object], where: str, base: SimulationSpec | None = None
) -> SimulationSpec:
    """A spec from ``entries`` (over ``base``'s), refusing a key it does not know, named with ``where``."""
    known = {f.name for f in fields(SimulationSpec)}
    if unknown := sorted(set(entries) - known):
        raise SimulationSpecError(f"{where}: unknown simulated-engine keys {unknown}; known: {sorted(known)}")
    try:
        return SimulationSpec(**{**(asdict(base) if base else {}), **entries})
    except SimulationSpecError as e:
        raise SimulationSpecError(f"{where}: {e}") from None


def write_simulated_model(path: str | Path, spec: SimulationSpec) -> Path:
    """A model directory ``rlmesh engine --model-path`` (and a replica) loads as a simulated engine."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(
        json.dumps({"model_type": SIMULATED_MODEL_TYPE, **asdict(spec)}, indent=1)
    )
    return out


def read_simulation_spec(path: str | Path) -> SimulationSpec | None:
    """The spec of a simulated model directory; None for any other directory (a real model)."""
    config = Path(path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("model_type") != SIMULATED_MODEL_TYPE:
        return None
    return simulation_spec({k: v for k, v in data.items() if k != "model_type"}, str(config))


class SimulatedModel(nn.Module):
    """Stands where the embedded engine holds its HF model: a config, no generation config, and
    weight tensors the weight-update routes write into and read back like a real model's."""

    def __init__(self, spec: SimulationSpec) -> None:
        super().__init__()
        self.spec = spec
        self.config = SimpleNamespace(
            model_type=SIMULATED_MODEL_TYPE,
            vocab_size=spec.vocab_size,
            eos_token_id=spec.eos_token_id,
            max_position_embeddings=spec.context,
        )
        self.generation_config = None
        for name, elements in spec.tensor_shapes():
            self.register_parameter(
                name, nn.Parameter(torch.zeros(elements, dtype=spec.dtype), requires_grad=False)
            )


class SimulatedRunner:
    """The ``Runner`` of a ``SimulatedModel``: each row is given a target length when it is
    admitted; its logits allow any token but eos before it, only eos at it."""

    def __init__(self, model: SimulatedModel) -> None:
        self.spec = model.spec
        self.size = 0
        self._rng = random.Random(self.spec.seed)  # None: seeded from the OS
        self._targets: list[int] = []
        self._produced: list[int] = []  # tokens each row has been fed back (= sampled so far)
        self._step_s = 1.0 / self.spec.tokens_per_s

    def draw_length(self) -> int:
        s = self.spec
        length = round(math.exp(self._rng.gauss(math.log(s.length_median), s.length_sigma)))
        return min(max(length, 1), s.length_max)

    def _logits(self) -> torch.Tensor:
        logits = torch.zeros(self.size, self.spec.vocab_size)
        eos = self.spec.eos_token_id
        logits[:, eos] = float("-inf")
        ending = [r for r in range(self.size) if self._produced[r] + 1 >= self._targets[r]]
        if ending:
            # Finite, not -inf: a row whose min_new_tokens masks eos still has tokens to sample.
            logits[ending] = NEVER
            logits[ending, eos] = 0.0
        return logits

    def _pace(self, started: float, seconds: float) -> None:
        """Holds the step until it has taken ``seconds``: the simulated device's compute time."""
        left = seconds - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)

    def prefill(self, prompts: list[list[int]], copies: list[int]) -> torch.Tensor:
        started = time.perf_counter()
        rows = sum(copies)
        self._targets += [self.draw_length() for _ in range(rows)]
        self._produced += [0] * rows
        self.size += rows
        logits = self._logits()[-rows:]
        if self.spec.prefill_tokens_per_s:
            self._pace(started, sum(len(p) for p in prompts) / self.spec.prefill_tokens_per_s)
        return logits

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        self._produced = [n + 1 for n in self._produced]
        logits = self._logits()
        self._pace(started, self._step_s)
        return logits

    def retire(self, keep: list[int]) -> list[int]:
        self._targets = [self._targets[i] for i in keep]
        self._produced = [self._produced[i] for i in keep]
        self.size = len(keep)
        return keep

    def reset(self) -> None:
        self.size = 0
        self._targets, self._produced = [], []
