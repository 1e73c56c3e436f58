"""Trajectories to padded tensors, laid out as verl's ``DataProto.batch`` is; bad samples refused.

docs/internals.md#rlmeshlearnerppobatch"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rlmesh.algo import compute_data_metrics
from rlmesh.reward.values import MAX_REWARD_EXTRA_KEYS
from rlmesh.v1.trajectory_pb2 import Trajectory

__all__ = [
    "LOG_PROB_SLACK",
    "MAX_ABS_SCORE",
    "MAX_REWARD_EXTRA_KEYS",
    "MAX_TRAJECTORY_BYTES",
    "MIN_LOG_PROB",
    "BatchError",
    "PPOBatch",
    "batch_metrics",
    "build_batch",
    "compute_position_ids",
    "reward_extra_columns",
    "reward_extra_metrics",
    "reward_extra_name",
    "staleness_metrics",
    "validate_trajectory",
]


# Scores of rule-based rewards are O(1) and of reward models O(10): past 1e6 a score is a bug or a
# forgery, and one such score would swamp a group's mean and std (its square still fits a float32).
MAX_ABS_SCORE = 1e6
# Engines compute log-softmax in bf16/fp16, whose rounding can land just above 0; more is not a
# log-probability.
LOG_PROB_SLACK = 1e-3
# exp(-1e4) underflows any float: a log-probability below it says the value, not the token, is wrong,
# and would overflow the importance ratios it enters.
MIN_LOG_PROB = -1e4
# A trajectory of 32k prompt and 32k response tokens with both log-probs and its text is a few MiB.
MAX_TRAJECTORY_BYTES = 64 << 20
MAX_REWARD_EXTRA_NAME = 64
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_]")


class BatchError(ValueError):
    """A trajectory (or a whole batch) that must not be trained on; names the uid and the field."""

    def __init__(self, uid: str, field: str, reason: str) -> None:
        self.uid = uid
        self.field = field
        self.reason = reason
        super().__init__(f"trajectory {uid!r}: {field}: {reason}")


@dataclass
class PPOBatch:
    """One training batch in verl's layout (see the module docstring for the shapes).

    ``index`` is verl's ``uid`` non-tensor column: the prompt (group) id of each row, which the
    group-based advantage estimators group by. ``has_rollout_log_probs`` marks rows whose
    trajectory carried rollout log-probs (the others hold zeros in ``rollout_log_probs``).
    ``reward_baselines`` is verl's ``(bs,)`` column of the same name (ReMax: the score of each
    row's prompt's greedy response), None when the trajectories carry no baseline.
    """

    prompts: torch.Tensor
    responses: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor | None
    token_level_scores: torch.Tensor
    scores: torch.Tensor
    has_rollout_log_probs: torch.Tensor
    index: np.ndarray
    uids: list[str]
    policy_versions: np.ndarray
    token_policy_versions: np.ndarray
    data_sources: list[str] = field(default_factory=list)
    reward_baselines: torch.Tensor | None = None
    # The reward function's extra values by metric name (reward_extra_columns): (bs,) float64, NaN
    # where a row's reward did not return that key.
    reward_extra: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_length(self) -> int:
        return int(self.prompts.shape[1])

    @property
    def response_length(self) -> int:
        return int(self.responses.shape[1])

    def select(self, rows: Sequence[int] | torch.Tensor) -> PPOBatch:
        """The rows ``rows`` (in that order), same widths."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        np_idx = idx.numpy()
        return PPOBatch(
            prompts=self.prompts[idx],
            responses=self.responses[idx],
            input_ids=self.input_ids[idx],
            attention_mask=self.attention_mask[idx],
            position_ids=self.position_ids[idx],
            response_mask=self.response_mask[idx],
            rollout_log_probs=self.rollout_log_probs[idx],
            ref_log_probs=None if self.ref_log_probs is None else self.ref_log_probs[idx],
            token_level_scores=self.token_level_scores[idx],
            scores=self.scores[idx],
            has_rollout_log_probs=self.has_rollout_log_probs[idx],
            index=self.index[np_idx],
            uids=[self.uids[i] for i in np_idx],
            policy_versions=self.policy_versions[np_idx],
            token_policy_versions=self.token_policy_versions[np_idx],
            data_sources=[self.data_sources[i] for i in np_idx] if self.data_sources else [],
            reward_baselines=None if self.reward_baselines is None else self.reward_baselines[idx],
            reward_extra={name: values[np_idx] for name, values in self.reward_extra.items()},
        )


def _values(values: Sequence[float] | Sequence[int]) -> np.ndarray:
    """A repeated field as an array: numpy reads protobuf's repeated scalars in one C copy, where a
    Python loop over them costs ~30 ns a value (16k trajectories of 4k tokens: tens of seconds)."""
    return np.asarray(values)


def _finite(values: Sequence[float]) -> bool:
    return bool(np.isfinite(_values(values)).all())


def _problem(t: Trajectory) -> tuple[str, str] | None:
    """(field, reason) of the first thing wrong with a trajectory, or None."""
    if t.HasField("error") and (t.error.code != 0 or t.error.message):
        err = t.error
        return "error", f"the sample failed ({err.source or 'unknown source'}: {err.message or err.code})"
    if not math.isfinite(t.score):
        return "score", f"score is not finite ({t.score})"
    if t.HasField("baseline_score") and not math.isfinite(t.baseline_score):
        return "baseline_score", f"baseline_score is not finite ({t.baseline_score})"
    n = len(t.response_ids)
    if n == 0:
        return "response_ids", "the response is empty"
    if len(t.prompt_ids) == 0:
        return "prompt_ids", "the prompt is empty"
    for name in ("prompt_ids", "response_ids"):
        if _values(getattr(t, name)).min() < 0:
            return name, "holds a negative token id"
    for name in ("rollout_log_probs", "ref_log_probs"):
        values = getattr(t, name)
        if len(values) and len(values) != n:
            return name, f"has {len(values)} values for {n} response tokens"
        if not _finite(values):
            return name, "holds a non-finite value"
    versions = t.token_policy_versions
    if len(versions):
        if len(versions) != n:
            return "token_policy_versions", f"has {len(versions)} values for {n} response tokens"
        oldest = int(_values(versions).min())
        if oldest < t.policy_version:
            return (
                "token_policy_versions",
                f"a token of version {oldest}, older than the trajectory's policy_version "
                f"{t.policy_version}, which must be the oldest",
            )
    return None


def _bounds_problem(
    t: Trajectory,
    vocab_size: int | None,
    max_prompt_length: int | None,
    max_response_length: int | None,
    max_bytes: int,
) -> tuple[str, str] | None:
    """(field, reason) of the first value of ``t`` outside what a step can take, or None."""
    size = t.ByteSize()
    if size > max_bytes:
        return "trajectory", f"{size} bytes, more than {max_bytes}"
    for name, limit in (("prompt_ids", max_prompt_length), ("response_ids", max_response_length)):
        if limit is not None and len(getattr(t, name)) > limit:
            return name, f"{len(getattr(t, name))} tokens, more than the configured {limit}"
    if vocab_size is not None:
        for name in ("prompt_ids", "response_ids"):
            top = int(_values(getattr(t, name)).max())
            if top >= vocab_size:
                return name, f"holds token id {top}, outside the vocabulary of {vocab_size}"
    scores = [("score", t.score)]
    if t.HasField("baseline_score"):
        scores.append(("baseline_score", t.baseline_score))
    for name, value in scores:
        if not math.isfinite(value) or abs(value) > MAX_ABS_SCORE:
            return name, f"{value} is not a finite value within +-{MAX_ABS_SCORE:g}"
    for name in ("rollout_log_probs", "ref_log_probs"):
        values = _values(getattr(t, name))
        if len(values) and (values.max() > LOG_PROB_SLACK or values.min() < MIN_LOG_PROB):
            return name, f"holds a value outside [{MIN_LOG_PROB:g}, 0]: not a log-probability"
    return None


def validate_trajectory(
    t: Trajectory,
    needs_ref: bool = False,
    needs_baseline: bool = False,
    *,
    vocab_size: int | None = None,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    max_bytes: int = MAX_TRAJECTORY_BYTES,
) -> str | None:
    """Why ``t`` must not be trained on, or None when it is fine. Nothing a trajectory carries may
    end a run: whatever would fail the step later is refused here.

    Refused: ``error`` set, a non-finite ``score`` or ``baseline_score``, an empty response or
    prompt, a negative token id, ``rollout_log_probs``/``ref_log_probs`` whose length is not the
    response length or that hold NaN/inf; more than ``max_bytes``; a prompt or response longer
    than ``max_prompt_length``/``max_response_length`` (the configured limits, when given); a token
    id at or past ``vocab_size`` (the model's, when given); a score or baseline past
    +-``MAX_ABS_SCORE``; a log-prob above 0 (``LOG_PROB_SLACK``) or below ``MIN_LOG_PROB``; with
    ``needs_ref`` (the run's KL needs the reference), no ``ref_log_probs``: a replica configured
    without a reference service must not stop the run; with ``needs_baseline``
    (``algorithm.adv_estimator=remax``), no ``baseline_score``. The reason starts with the field name.
    """
    problem = _problem(t)
    if problem is None:
        problem = _bounds_problem(t, vocab_size, max_prompt_length, max_response_length, max_bytes)
    if problem is None and needs_ref and not t.ref_log_probs:
        problem = (
            "ref_log_probs",
            f"missing, and this run's KL needs them; replica {t.replica_id!r} runs without a "
            "reference service (is its config the learner's?)",
        )
    if problem is None and needs_baseline and not t.HasField("baseline_score"):
        problem = (
            "baseline_score",
            f"missing, and algorithm.adv_estimator=remax needs the greedy response's score; "
            f"replica {t.replica_id!r} did not generate one (an older replica?)",
        )
    return None if problem is None else f"{problem[0]}: {problem[1]}"


def reward_extra_name(key: str) -> str:
    """A reward's extra key as a metric name part: ASCII letters, digits and ``_`` (anything else
    becomes ``_``), at most ``MAX_REWARD_EXTRA_NAME`` characters. Prometheus takes it as it is, and
    two names that differ stay two gauges (the learner's gauge name turns every other character
    into ``_`` too)."""
    return _NOT_IN_NAME.sub("_", key)[:MAX_REWARD_EXTRA_NAME] or "_"


def reward_extra_columns(
    extras: Sequence[Mapping[str, float]], max_keys: int = MAX_REWARD_EXTRA_KEYS
) -> dict[str, np.ndarray]:
    """The extra values of ``extras`` (one mapping per sample, as ``Trajectory.reward_extra``) by
    metric name: ``{name: (n,) float64}``, NaN where a sample has no value for it.

    Keys become names by :func:`reward_extra_name`; the first ``max_keys`` names in sorted order
    are kept, the rest dropped. Keys that give one name are one column, the value of the first key
    in sorted order winning in a sample that has several.
    """
    names: dict[str, str] = {}
    for key in sorted({k for e in extras for k in e}):
        names[key] = reward_extra_name(key)
    kept = sorted(set(names.values()))[:max_keys]
    columns = {name: np.full(len(extras), np.nan) for name in kept}
    for i, extra in enumerate(extras):
        for key in sorted(extra, reverse=True):  # the first key in sorted order is written last
            column = columns.get(names[key])
            if column is not None:
                column[i] = extra[key]
    return columns


def reward_extra_metrics(reward_extra: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``reward_extra/<name>/mean``: each extra value's mean over the samples that have it (verl
    logs them only at validation, as ``val-core``/``val-aux``; rlmesh also logs them every step)."""
    return {
        f"reward_extra/{name}/mean": float(np.nanmean(values))
        for name, values in reward_extra.items()
        if not np.isnan(values).all()
    }


def compute_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``compute_position_id_with_mask``: ``clip(cumsum(mask) - 1, min=0)``, ``(bs, L)``."""
    return torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)


def build_batch(
    trajectories: Sequence[Trajectory],
    pad_token_id: int,
    *,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    with_ref: bool | None = None,
    with_baselines: bool | None = None,
) -> PPOBatch:
    """Pad ``trajectories``  into a :class:`PPOBatch`.

    Args:
        trajectories: at least one; all valid (see :func:`validate_trajectory`).
        pad_token_id: written at padded positions of ``prompts``/``responses``/``input_ids``.
        max_prompt_length: pad prompts to this width (verl pads to ``data.max_prompt_length``);
            default the longest prompt.
        max_response_length: pad responses to this width (verl: ``data.max_response_length``);
            default the longest response.
        with_ref: whether the batch carries reference log-probs (every trajectory must have
            them; False: any are ignored); default whether the trajectories carry them.
        with_baselines: whether the batch carries ``reward_baselines`` (every trajectory must
            have a ``baseline_score``; False: any are ignored); default whether the
            trajectories carry them.

    Raises:
        BatchError: an invalid trajectory (named by uid and field), ref log-probs or baselines
            on some trajectories but not others, or a sequence longer than a given width.
    """
    if not trajectories:
        raise ValueError("build_batch needs at least one trajectory")
    for t in trajectories:
        problem = _problem(t)
        if problem is not None:
            raise BatchError(t.uid, *problem)
    has_ref = [len(t.ref_log_probs) > 0 for t in trajectories]
    if with_ref is None:
        with_ref = any(has_ref)
    if with_ref and not all(has_ref):
        missing = next(t for t, has in zip(trajectories, has_ref, strict=True) if not has)
        raise BatchError(missing.uid, "ref_log_probs", "missing while the batch needs them")
    has_baseline = [t.HasField("baseline_score") for t in trajectories]
    if with_baselines is None:
        with_baselines = any(has_baseline)
    if with_baselines and not all(has_baseline):
        missing = next(t for t, has in zip(trajectories, has_baseline, strict=True) if not has)
        raise BatchError(missing.uid, "baseline_score", "missing while the batch needs them")

    prompt_lens = [len(t.prompt_ids) for t in trajectories]
    response_lens = [len(t.response_ids) for t in trajectories]
    width_p = max(prompt_lens) if max_prompt_length is None else max_prompt_length
    width_r = max(response_lens) if max_response_length is None else max_response_length
    for t, lp, lr in zip(trajectories, prompt_lens, response_lens, strict=True):
        if lp > width_p:
            raise BatchError(t.uid, "prompt_ids", f"{lp} tokens exceed max_prompt_length={width_p}")
        if lr > width_r:
            raise BatchError(t.uid, "response_ids", f"{lr} tokens exceed max_response_length={width_r}")

    bs = len(trajectories)
    # Filled as numpy arrays (row slices take a repeated field without a Python loop), then shared.
    prompts_np = np.full((bs, width_p), pad_token_id, dtype=np.int64)
    responses_np = np.full((bs, width_r), pad_token_id, dtype=np.int64)
    prompt_mask_np = np.zeros((bs, width_p), dtype=np.int64)
    response_mask_np = np.zeros((bs, width_r), dtype=np.int64)
    rollout_np = np.zeros((bs, width_r), dtype=np.float32)
    ref_np = np.zeros((bs, width_r), dtype=np.float32) if with_ref else None
    has_rollout_np = np.zeros(bs, dtype=bool)
    for i, t in enumerate(trajectories):
        lp, lr = prompt_lens[i], response_lens[i]
        prompts_np[i, width_p - lp :] = _values(t.prompt_ids)
        prompt_mask_np[i, width_p - lp :] = 1
        responses_np[i, :lr] = _values(t.response_ids)
        response_mask_np[i, :lr] = 1
        if len(t.rollout_log_probs):
            rollout_np[i, :lr] = _values(t.rollout_log_probs)
            has_rollout_np[i] = True
        if ref_np is not None:
            ref_np[i, :lr] = _values(t.ref_log_probs)
    prompts, responses = torch.from_numpy(prompts_np), torch.from_numpy(responses_np)
    prompt_mask, response_mask = torch.from_numpy(prompt_mask_np), torch.from_numpy(response_mask_np)
    rollout_log_probs = torch.from_numpy(rollout_np)
    ref_log_probs = torch.from_numpy(ref_np) if ref_np is not None else None
    has_rollout = torch.from_numpy(has_rollout_np)

    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    scores = torch.tensor([t.score for t in trajectories], dtype=torch.float32)
    return PPOBatch(
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=compute_position_ids(attention_mask),
        response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
        ref_log_probs=ref_log_probs,
        token_level_scores=scores_on_last_token(scores, response_lens, width_r),
        scores=scores,
        has_rollout_log_probs=has_rollout,
        index=np.array([t.group_uid for t in trajectories], dtype=object),
        uids=[t.uid for t in trajectories],
        policy_versions=np.array([t.policy_version for t in trajectories], dtype=np.int64),
        token_policy_versions=token_policy_versions(trajectories, width_r),
        data_sources=[t.data_source for t in trajectories],
        reward_baselines=(
            torch.tensor([t.baseline_score for t in trajectories], dtype=torch.float32)
            if with_baselines
            else None
        ),
        reward_extra=reward_extra_columns([t.reward_extra for t in trajectories]),
    )


def scores_on_last_token(scores: torch.Tensor, response_lengths: Sequence[int], width: int) -> torch.Tensor:
    """``place_scores_on_last_token`` from the response lengths build_batch already has: ``(bs,
    width)`` zeros with each score at its response's last token (none for an empty response),
    without the where/amax over the whole mask (at 4k x 4k tokens a fifth of build_batch's time)."""
    out = torch.zeros((len(response_lengths), width), dtype=scores.dtype)
    lengths = torch.as_tensor(response_lengths, dtype=torch.long)
    rows = torch.nonzero(lengths > 0).squeeze(1)
    out[rows, lengths[rows] - 1] = scores[rows]
    return out


def batch_metrics(
    batch: PPOBatch,
    token_level_rewards: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor | None,
    max_response_length: int,
    max_prompt_length: int,
) -> dict[str, float]:
    """verl's data metrics of a trained batch (:func:`rlmesh.algo.compute_data_metrics`):
    ``critic/{score,rewards,advantages,returns,values}/{mean,max,min}``, ``critic/vf_explained_var``,
    ``{response,prompt}_length/{mean,max,min,clip_ratio}`` (the share of samples at
    ``max_response_length`` / ``max_prompt_length``), ``response_length_non_aborted/*`` and
    ``response/aborted_ratio`` (0 here: empty responses are refused before a batch is built); and
    ``reward_extra/<name>/mean`` for each extra value of the reward function
    (:func:`reward_extra_metrics`).
    """
    metrics = compute_data_metrics(
        batch.token_level_scores,
        token_level_rewards,
        advantages,
        returns,
        batch.response_mask,
        batch.attention_mask,
        max_prompt_length,
        max_response_length,
        values,
    )
    metrics.update(reward_extra_metrics(batch.reward_extra))
    return metrics


def token_policy_versions(trajectories: Sequence[Trajectory], width: int) -> np.ndarray:
    """(bs, width) int64: the version that sampled each response token (``token_policy_versions``,
    else the trajectory's ``policy_version`` for all of it); padding holds the row's last value."""
    versions_of = np.array([t.policy_version for t in trajectories], dtype=np.int64)
    out = np.repeat(versions_of[:, None], width, axis=1)  # one write, not a row at a time
    for i, t in enumerate(trajectories):
        if len(t.token_policy_versions):
            versions = np.asarray(t.token_policy_versions, dtype=np.int64)
            out[i, : len(versions)] = versions
            out[i, len(versions) :] = versions[-1]
    return out


def staleness_metrics(batch: PPOBatch, version: int) -> dict[str, float]:
    """``training/staleness/{mean,max,min}`` over the batch's response tokens: how many policy
    versions the weights that sampled each token lag ``version``, the weights the step trains (0
    for every token of a synchronous run, at most ``rlmesh.max_staleness`` in an asynchronous one;
    a response sampled across an in-place weight update has tokens of several versions)."""
    mask = batch.response_mask.numpy().astype(bool)
    lag = int(version) - batch.token_policy_versions[mask]
    return {
        "training/staleness/mean": float(lag.mean()),
        "training/staleness/max": float(lag.max()),
        "training/staleness/min": float(lag.min()),
    }
