"""Validation: generate for ``data.val_files`` through the rollout replicas, score with the reward
service, report ``val/score``, verl's ``val-core``/``val-aux`` (score and reward extras) and the failed
rewards, keep the samples for ``trainer.log_val_generations``. docs/train.md#the-reward-function"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmesh.algo.diagnostics import process_validation_metrics
from rlmesh.data import PromptItem
from rlmesh.learner.ppo.batch import reward_extra_columns
from rlmesh.reward.failures import FailureTally, RewardErrorRule
from rlmesh.runtime.auth import client_auth_interceptors
from rlmesh.runtime.tls import aio_channel
from rlmesh.v1 import common_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger("rlmesh.learner")


def val_sampling(val_kwargs: Any, max_new_tokens: int) -> common_pb2.SamplingParams:
    greedy = not val_kwargs.do_sample or val_kwargs.temperature == 0
    params = common_pb2.SamplingParams(
        max_new_tokens=max_new_tokens,
        n=val_kwargs.n,
        temperature=0.0 if greedy else val_kwargs.temperature,
        top_p=val_kwargs.top_p,
    )
    if val_kwargs.top_k > 0:
        params.top_k = val_kwargs.top_k
    return params


@dataclass(frozen=True)
class ValGeneration:
    """One validation sample: the prompt as the model saw it, what it answered, and its score."""

    input: str
    output: str
    score: float
    ground_truth: str
    data_source: str
    index: int  # the prompt's index in the validation set
    sample_index: int  # which of the prompt's val_kwargs.n samples

    def row(self) -> dict[str, Any]:
        """As JSON holds it: a score that is not finite is null."""
        return {
            "input": self.input,
            "output": self.output,
            "score": self.score if math.isfinite(self.score) else None,
            "ground_truth": self.ground_truth,
            "data_source": self.data_source,
            "index": self.index,
            "sample_index": self.sample_index,
        }


@dataclass
class ValidationResult:
    metrics: dict[str, float]
    samples: list[ValGeneration] = field(default_factory=list)  # in validation-set order
    failures: FailureTally = field(default_factory=FailureTally)  # the samples whose reward failed


def val_core_metrics(
    data_sources: Sequence[str], sample_uids: Sequence[Hashable], infos: Mapping[str, Sequence[float]]
) -> dict[str, float]:
    """verl's validation metrics (``RayPPOTrainer._val_metrics_update``) of ``infos`` (``reward``,
    the score, and the reward function's extra values; NaN where a sample has none), one value per
    sample: ``<section>/<data_source>/<variable>/<metric>`` for :func:`process_validation_metrics`'
    metrics. The section is ``val-core`` for the core variable (``acc`` when the reward returns
    one, else ``reward``) and its ``mean``/``best`` metrics at the most samples per prompt
    (``mean@N``, ``best@N/*``); ``val-aux`` for everything else."""
    metrics: dict[str, float] = {}
    for source, variables in process_validation_metrics(data_sources, sample_uids, infos).items():
        core = "acc" if "acc" in variables else "reward"
        for var, values in variables.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in values)
            for name, value in values.items():
                is_core = var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                metrics[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{name}"] = value
    return metrics


def select_generations(samples: Sequence[ValGeneration], count: int) -> list[ValGeneration]:
    """The ``count`` samples a validation logs, chosen as verl's ``_maybe_log_val_generations``
    does: sorted by input text, shuffled with a fixed seed (42), the first ``count`` kept. The
    same validation set gives the same prompts at every validation, so their answers can be
    compared across steps. Ties (one prompt's samples) are broken by prompt and sample index, so
    the choice does not depend on the order the replicas answered in."""
    if count <= 0:
        return []
    chosen = sorted(samples, key=lambda s: (s.input, s.index, s.sample_index))
    np.random.RandomState(42).shuffle(chosen)
    return chosen[:count]


async def run_validation(
    items: Sequence[PromptItem],
    *,
    replicas: Sequence[str],
    score: Callable[[list[reward_pb2.RewardSample]], Any],
    decode: Callable[[list[int]], str],
    sampling: common_pb2.SamplingParams,
    batch_size: int = 64,
    token: str | None = None,
    timeout_s: float = 600.0,
    rule: RewardErrorRule | None = None,
) -> ValidationResult:
    """Validates ``items`` on ``replicas``, scored by ``score``; a sample whose reward failed scores
    by ``rule`` (default: penalty 0.0) and counts in ``val/reward/failed`` and ``failed_ratio``."""
    rule = rule or RewardErrorRule()
    if not replicas:
        raise RuntimeError("validation needs at least one live rollout replica")
    channels = [aio_channel(a, interceptors=client_auth_interceptors(token)) for a in replicas]
    stubs = itertools.cycle([rollout_pb2_grpc.RolloutStub(c) for c in channels])
    scores: dict[str, list[float]] = defaultdict(list)
    lengths: list[int] = []
    generations: list[ValGeneration] = []
    failures = FailureTally()
    # (prompt index, sample index, data source, score or NaN, the reward's extra values)
    per_sample: list[tuple[int, int, str, float, Mapping[str, float]]] = []

    async def run_chunk(chunk: Sequence[PromptItem], stub: rollout_pb2_grpc.RolloutStub) -> None:
        reply = await stub.Generate(
            rollout_pb2.GenerateRequest(
                inputs=[
                    rollout_pb2.GenerateInput(uid=str(it.index), prompt_ids=it.prompt_ids) for it in chunk
                ],
                sampling_params=sampling,
                return_logprob=False,
            ),
            timeout=timeout_s,
        )
        by_index = {str(it.index): it for it in chunk}
        samples = []
        origins = []
        for out in reply.outputs:
            item = by_index[out.uid]
            lengths.append(len(out.output_ids))
            origins.append((item.index, out.sample_index))
            samples.append(
                reward_pb2.RewardSample(
                    uid=f"val-{out.uid}-{out.sample_index}",
                    prompt_text=item.prompt_text,
                    prompt_ids=item.prompt_ids,
                    response_text=decode(list(out.output_ids)),
                    response_ids=out.output_ids,
                    ground_truth=str(item.ground_truth),
                    data_source=item.data_source,
                    # verl gives the reward function the row's extra_info in validation too.
                    extra_info_json=json.dumps(item.extra_info, default=str),
                )
            )
        results = await score(samples)
        for sample, origin, result in zip(samples, origins, results, strict=True):
            # Every error a Score result carries is the reward's.
            failed = result.HasField("error") and bool(result.error.code or result.error.message)
            failures.add((result.error.message or result.error.source) if failed else None)
            value = rule.validation_score(result.score, failed)
            if value is not None:
                scores[sample.data_source].append(value)
            per_sample.append(
                (*origin, sample.data_source, math.nan if value is None else value, dict(result.extra))
            )
            generations.append(
                ValGeneration(
                    input=sample.prompt_text,
                    output=sample.response_text,
                    score=float(value) if value is not None else math.nan,  # logged as null
                    ground_truth=sample.ground_truth,
                    data_source=sample.data_source,
                    index=origin[0],
                    sample_index=origin[1],
                )
            )

    try:
        chunks = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
        await asyncio.gather(*(run_chunk(c, next(stubs)) for c in chunks))
    finally:
        for c in channels:
            await c.close()
    everything = [s for v in scores.values() for s in v]
    metrics = {
        "val/score": sum(everything) / max(1, len(everything)),
        "val/response_length/mean": sum(lengths) / max(1, len(lengths)),
        **failures.metrics("val/reward"),
    }
    # Under on_error=drop a data source whose every reward failed has no score, rather than 0.
    for source, values in scores.items():
        metrics[f"val/score/{source}"] = sum(values) / len(values)
    # In validation-set order: verl's bootstrap draws samples by their position within a prompt.
    per_sample.sort(key=lambda s: (s[0], s[1]))
    extras = reward_extra_columns([s[4] for s in per_sample])
    extras.pop("reward", None)  # the score is "reward"; an extra of that name would hide it
    infos = {"reward": [s[3] for s in per_sample], **extras}
    # Off the event loop: with val_kwargs.n > 1 the bootstrap of every variable takes a while.
    sources, uids = [s[2] for s in per_sample], [s[0] for s in per_sample]
    metrics.update(await asyncio.to_thread(val_core_metrics, sources, uids, infos))
    # Chunks finish in any order: the samples in the validation set's.
    generations.sort(key=lambda g: (g.index, g.sample_index))
    return ValidationResult(metrics, generations, failures)
