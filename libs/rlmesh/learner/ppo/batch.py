"""Trajectories to padded tensors, laid out as verl's ``DataProto.batch`` is; bad samples refused.

docs/internals.md#rlmeshlearnerppobatch"""

from __future__ import annotations

import math
import re
import sys
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
    "BatchBuffers",
    "BatchBuilder",
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

    def __getstate__(self) -> dict[str, object]:
        # BatchBuilder's tensors are views into buffers of the configured widths; torch pickles a
        # view's whole storage, so the other ranks would be sent every buffer whole.
        return {name: _compact(value) for name, value in self.__dict__.items()}

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


def _compact(value: object) -> object:
    """``value``, or a tensor's own copy where it is a view of a larger storage."""
    if (
        isinstance(value, torch.Tensor)
        and value.untyped_storage().nbytes() != value.numel() * value.element_size()
    ):
        return value.clone(memory_format=torch.contiguous_format)
    return value


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


class BatchBuffers:
    """The arrays :class:`BatchBuilder` writes a batch into, kept for the next batch of the same
    shape once nothing holds the last one (its tensors are views of them): a 7B-shaped step's
    3.3 GB is then not faulted in anew every step (on this machine faulting it in cost more than
    writing it). Only the region the last batch used is cleared."""

    def __init__(self) -> None:
        self._kept: dict[str, np.ndarray] = {}
        self._shape: tuple[int, int, int, bool] | None = None
        self._used = (0, 0, 0)  # rows, prompt and response width of the last batch
        self.reused = 0  # how many times the arrays were taken again

    def take(
        self, rows: int, max_prompt_length: int, max_response_length: int, with_ref: bool
    ) -> dict[str, np.ndarray]:
        """Arrays for a batch of this shape: the kept ones, cleared, when nothing else holds them.

        ``ids`` and ``versions`` are written over the whole padded window of every row; the others
        are 0 wherever a row is not written (new: np.zeros, calloc'd, whose untouched pages cost
        nothing; kept: the last batch's region set to 0)."""
        shape = (rows, max_prompt_length, max_response_length, with_ref)
        kept, self._kept = self._kept, {}
        # A reference from anywhere but ``kept`` (and getrefcount's argument) is a batch in use.
        if kept and self._shape == shape and all(sys.getrefcount(kept[name]) == 2 for name in kept):
            n, p, r = self._used
            P = max_prompt_length
            kept["attention_mask"][:n, P - p : P + r] = 0
            kept["position_ids"][:n, P - p : P + r] = 0
            for name in ("rollout", "ref", "token_scores"):
                if name in kept:
                    kept[name][:n, :r] = 0
            kept["has_rollout"][:n] = False
            self.reused += 1
            return kept
        width = max_prompt_length + max_response_length
        arrays = {
            "ids": np.empty((rows, width), dtype=np.int64),
            "attention_mask": np.zeros((rows, width), dtype=np.int64),
            "position_ids": np.zeros((rows, width), dtype=np.int64),
            "rollout": np.zeros((rows, max_response_length), dtype=np.float32),
            "token_scores": np.zeros((rows, max_response_length), dtype=np.float32),
            "versions": np.empty((rows, max_response_length), dtype=np.int64),
            "has_rollout": np.zeros(rows, dtype=bool),
            # Each row's last position and version, which its right padding repeats.
            "last_position": np.zeros(rows, dtype=np.int64),
            "last_version": np.zeros(rows, dtype=np.int64),
        }
        if with_ref:
            arrays["ref"] = np.zeros((rows, max_response_length), dtype=np.float32)
        self._shape = shape
        return arrays

    def keep(self, arrays: dict[str, np.ndarray], rows: int, prompt_width: int, response_width: int) -> None:
        """Keeps ``arrays`` (a batch's, written to ``rows`` rows within these widths) for the next."""
        self._kept, self._used = arrays, (rows, prompt_width, response_width)


class BatchBuilder:
    """A :class:`PPOBatch` written a group at a time, as its trajectories arrive.

    Rows go into buffers of the configured widths, made once per batch; every row placed is kept
    padded to the longest prompt and response placed so far (a longer one pads the rows before it
    by one block write per column). :meth:`finish` is then views narrowed to those widths and the
    per-row columns: what is left to do when a step's last group arrives is that group's rows, not
    the whole batch (16k rows of 4k tokens took 12 s to pad at once; docs/scale.md).

    The views share buffers: ``prompts`` and ``responses`` are column ranges of ``input_ids``,
    ``response_mask`` of ``attention_mask``. A pickled batch sends only its views' values.
    """

    def __init__(
        self,
        pad_token_id: int,
        *,
        rows: int,
        max_prompt_length: int,
        max_response_length: int,
        with_ref: bool,
        with_baselines: bool | None = None,
        buffers: BatchBuffers | None = None,
    ) -> None:
        """``rows``: the trajectories expected (more grow the arrays); ``with_ref``: every trajectory
        must carry reference log-probs (False: any are ignored); ``with_baselines``: every one must
        carry a ``baseline_score`` (False: any are ignored; None: all must when any does);
        ``buffers``: where the arrays are taken from, and given back to by :meth:`finish`."""
        width = max_prompt_length + max_response_length
        self.pad_token_id = pad_token_id
        self.rows = rows
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.with_ref = with_ref
        self.with_baselines = with_baselines
        self.n = 0  # rows placed
        self.prompt_width = 0  # the window every placed row is padded to
        self.response_width = 0
        self._buffers = buffers
        self._use((buffers or BatchBuffers()).take(rows, max_prompt_length, max_response_length, with_ref))
        self._arange = np.arange(width, dtype=np.int64)
        self._uids: list[str] = []
        self._group_uids: list[str] = []
        self._policy_versions: list[int] = []
        self._data_sources: list[str] = []
        self._scores: list[float] = []
        self._baselines: list[float | None] = []
        self._extras: list[Mapping[str, float]] = []

    def _use(self, arrays: dict[str, np.ndarray]) -> None:
        self._arrays = arrays
        self._ids = arrays["ids"]
        self._attention_mask = arrays["attention_mask"]
        self._position_ids = arrays["position_ids"]
        self._rollout = arrays["rollout"]
        self._ref = arrays.get("ref")
        self._token_scores = arrays["token_scores"]
        self._versions = arrays["versions"]
        self._has_rollout = arrays["has_rollout"]
        self._last_position = arrays["last_position"]
        self._last_version = arrays["last_version"]

    def _grow(self, rows: int) -> None:
        """Room for ``rows``: a group with more samples than asked for (a replica told another
        ``n``) is trained on whole, as it was before rows were written as groups came."""
        bigger = BatchBuffers().take(rows, self.max_prompt_length, self.max_response_length, self.with_ref)
        for name, array in self._arrays.items():
            bigger[name][: self.n] = array[: self.n]
        self.rows = rows
        self._use(bigger)

    def widen(self, prompt_width: int, response_width: int) -> None:
        """Pads every row, those placed and those to come, to at least these widths."""
        P, n = self.max_prompt_length, self.n
        if prompt_width > self.prompt_width:
            self._ids[:n, P - prompt_width : P - self.prompt_width] = self.pad_token_id
            self.prompt_width = prompt_width
        if response_width > self.response_width:
            old = slice(P + self.response_width, P + response_width)
            self._ids[:n, old] = self.pad_token_id
            self._position_ids[:n, old] = self._last_position[:n, None]
            self._versions[:n, self.response_width : response_width] = self._last_version[:n, None]
            self.response_width = response_width

    def add(self, trajectories: Sequence[Trajectory]) -> None:
        """Places ``trajectories`` (each valid, see :func:`validate_trajectory`) as the next rows.

        Raises:
            BatchError: an invalid trajectory, one without reference log-probs or a baseline the
                batch needs, or one longer than the configured widths; nothing of the call placed.
        """
        prompt_lens = [len(t.prompt_ids) for t in trajectories]
        response_lens = [len(t.response_ids) for t in trajectories]
        for t, lp, lr in zip(trajectories, prompt_lens, response_lens, strict=True):
            problem = _problem(t)
            if problem is not None:
                raise BatchError(t.uid, *problem)
            if self.with_ref and not len(t.ref_log_probs):
                raise BatchError(t.uid, "ref_log_probs", "missing while the batch needs them")
            if self.with_baselines and not t.HasField("baseline_score"):
                raise BatchError(t.uid, "baseline_score", "missing while the batch needs them")
            if lp > self.max_prompt_length:
                raise BatchError(
                    t.uid, "prompt_ids", f"{lp} tokens exceed max_prompt_length={self.max_prompt_length}"
                )
            if lr > self.max_response_length:
                raise BatchError(
                    t.uid,
                    "response_ids",
                    f"{lr} tokens exceed max_response_length={self.max_response_length}",
                )
        if not trajectories:
            return
        if self.n + len(trajectories) > self.rows:
            self._grow(max(2 * self.rows, self.n + len(trajectories)))
        self.widen(max(prompt_lens), max(response_lens))
        for t, lp, lr in zip(trajectories, prompt_lens, response_lens, strict=True):
            self._place(t, lp, lr)

    def _place(self, t: Trajectory, lp: int, lr: int) -> None:
        i, P, pad = self.n, self.max_prompt_length, self.pad_token_id
        ids, positions = self._ids[i], self._position_ids[i]
        ids[P - self.prompt_width : P - lp] = pad
        ids[P - lp : P] = _values(t.prompt_ids)
        ids[P : P + lr] = _values(t.response_ids)
        ids[P + lr : P + self.response_width] = pad
        self._attention_mask[i, P - lp : P + lr] = 1
        # verl's clip(cumsum(mask) - 1, min=0): 0 over the left padding, the last position after.
        positions[P - lp : P + lr] = self._arange[: lp + lr]
        positions[P + lr : P + self.response_width] = lp + lr - 1
        self._last_position[i] = lp + lr - 1
        if len(t.rollout_log_probs):
            self._rollout[i, :lr] = _values(t.rollout_log_probs)
            self._has_rollout[i] = True
        if self._ref is not None:
            self._ref[i, :lr] = _values(t.ref_log_probs)
        self._token_scores[i, lr - 1] = t.score  # _problem refuses an empty response
        versions = self._versions[i]
        if len(t.token_policy_versions):
            versions[:lr] = _values(t.token_policy_versions)
            last = int(versions[lr - 1])
        else:
            last = t.policy_version
            versions[:lr] = last
        versions[lr : self.response_width] = last
        self._last_version[i] = last
        self._uids.append(t.uid)
        self._group_uids.append(t.group_uid)
        self._policy_versions.append(t.policy_version)
        self._data_sources.append(t.data_source)
        self._scores.append(t.score)
        self._baselines.append(t.baseline_score if t.HasField("baseline_score") else None)
        self._extras.append(t.reward_extra)
        self.n += 1

    def finish(self) -> PPOBatch:
        """The rows placed, as a batch padded to the longest prompt and response among them (or
        the widths :meth:`widen` set)."""
        n = self.n
        if n == 0:
            raise ValueError("build_batch needs at least one trajectory")
        has_baseline = [b is not None for b in self._baselines]
        with_baselines = any(has_baseline) if self.with_baselines is None else self.with_baselines
        if with_baselines and not all(has_baseline):
            missing = self._uids[has_baseline.index(False)]
            raise BatchError(missing, "baseline_score", "missing while the batch needs them")
        P, p, r = self.max_prompt_length, self.prompt_width, self.response_width
        if self._buffers is not None:
            self._buffers.keep(self._arrays, n, p, r)
        window = slice(P - p, P + r)
        input_ids = torch.from_numpy(self._ids[:n, window])
        attention_mask = torch.from_numpy(self._attention_mask[:n, window])
        return PPOBatch(
            prompts=input_ids[:, :p],
            responses=input_ids[:, p:],
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=torch.from_numpy(self._position_ids[:n, window]),
            response_mask=attention_mask[:, p:],
            rollout_log_probs=torch.from_numpy(self._rollout[:n, :r]),
            ref_log_probs=None if self._ref is None else torch.from_numpy(self._ref[:n, :r]),
            token_level_scores=torch.from_numpy(self._token_scores[:n, :r]),
            scores=torch.tensor(self._scores, dtype=torch.float32),
            has_rollout_log_probs=torch.from_numpy(self._has_rollout[:n]),
            index=np.array(self._group_uids, dtype=object),
            uids=list(self._uids),
            policy_versions=np.array(self._policy_versions, dtype=np.int64),
            token_policy_versions=self._versions[:n, :r],
            data_sources=list(self._data_sources),
            reward_baselines=(torch.tensor(self._baselines, dtype=torch.float32) if with_baselines else None),
            reward_extra=reward_extra_columns(self._extras),
        )


def build_batch(
    trajectories: Sequence[Trajectory],
    pad_token_id: int,
    *,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    with_ref: bool | None = None,
    with_baselines: bool | None = None,
) -> PPOBatch:
    """Pad ``trajectories`` into a :class:`PPOBatch` at once (:class:`BatchBuilder` a group at a time).

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
    width_p = max(len(t.prompt_ids) for t in trajectories) if max_prompt_length is None else max_prompt_length
    width_r = (
        max(len(t.response_ids) for t in trajectories) if max_response_length is None else max_response_length
    )
    builder = BatchBuilder(
        pad_token_id,
        rows=len(trajectories),
        max_prompt_length=width_p,
        max_response_length=width_r,
        with_ref=any(len(t.ref_log_probs) > 0 for t in trajectories) if with_ref is None else with_ref,
        with_baselines=with_baselines,
    )
    builder.widen(width_p, width_r)
    builder.add(trajectories)
    return builder.finish()
