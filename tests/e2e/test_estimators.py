"""The advantage estimators the other end-to-end tests do not run (RLOO, REINFORCE++, REINFORCE++
with a baseline, ReMax) and an asynchronous run (``rlmesh.max_staleness=1``) with IS correction,
each a real ``rlmesh train`` job: its rollout replica, embedded engine and learner are OS
processes, and the jobs share one Redis and one reward service (each job its own run id), started
here; ``-k`` starts only the jobs of the selected tests.

The reward is the user's own function (``custom_reward_function``): the share of a response's
characters whose code point has the parity of the prompt's row, so a random tiny model's samples
score all over [0, 1] (and its greedy responses, often one character repeated, 0 or 1 by the
row). It writes every call to a trace. With ``ignore_eos`` every response has the same length, so the
advantages of a step follow from that step's scores alone: the test applies each estimator's
formula (written out here, not rlmesh's) to the scores the trace holds for the groups the learner
recorded for the step (``trained_groups.jsonl``) and compares with the statistics the learner
logged, and, per sample and token, with what ``rlmesh.algo`` (the learner's call) returns for that
batch, padding masked. A wrong estimator, wrong groups, a lost ``gamma``, a discount run the wrong
way in time or advantages moved between samples would each give other numbers. ReMax's
greedy baseline is one more reward call per prompt: the learner's record names each group's
baseline score, which must be that extra call's, and the other ``n`` calls are the samples'.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlmesh.algo import compute_advantage
from rlmesh.config import AlgorithmConfig, load_config
from rlmesh.data import RLHFDataset, generate_arithmetic
from rlmesh.job.stack import free_port_overrides
from rlmesh.models import build_tiny_model, build_tokenizer, load_tokenizer
from rlmesh.runtime.launcher import ProcessLauncher
from tests.support.jobs import Job
from tests.support.repo import CPU_DEMO

STEPS = 3  # each estimator's job
ASYNC_STEPS = 4  # the asynchronous job: step 1 is on-policy by construction, later ones may not be
PROMPTS, N, LENGTH = 4, 4, 6  # prompts per step, samples per prompt, response tokens
GAMMA = 0.9  # REINFORCE++ discounts with it; the group estimators must ignore it
PAD = 2  # masked positions after every response in the per-token check: nothing may leak into them
JOB_TIMEOUT_S = 500

REWARD_FILE = '''"""A test's own reward: the share of characters whose code point has the parity of the
prompt's row; every call traced."""

import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None, trace=None):
    parity = extra_info["index"] % 2
    score = sum(ord(c) % 2 == parity for c in solution_str) / len(solution_str) if solution_str else 0.0
    with open(trace, "a") as f:
        f.write(json.dumps({"job": extra_info["job"], "row": extra_info["index"], "score": score}) + "\\n")
    return score
'''

ESTIMATOR_JOBS = ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")
JOBS: dict[str, list[str]] = {
    **{
        name: [f"algorithm.adv_estimator={name}", f"trainer.total_training_steps={STEPS}"]
        for name in ESTIMATOR_JOBS
    },
    "async": [
        "algorithm.adv_estimator=grpo",
        f"trainer.total_training_steps={ASYNC_STEPS}",
        "rlmesh.max_staleness=1",
        "algorithm.rollout_correction.rollout_is=token",
    ],
}
# Metrics only a critic produces (its loss, values, optimizer).
CRITIC_ONLY = ("critic/vf_", "critic/values/", "critic/grad_norm", "critic/lr", "critic/skipped_steps")


@dataclass
class Finished:
    run_dir: Path
    output: str
    summary: dict
    rows: list[dict[str, float]]  # metrics.jsonl, one row per step
    groups: dict[int, list[list[float]]]  # step -> each trained group's scores (from the trace)
    baselines: dict[int, list[float]]  # step -> each group's greedy baseline score (remax only)


class Jobs:
    """The module's jobs, all started at once; ``finished(name)`` waits for one and reads it."""

    def __init__(self, root: Path, trace: Path, index_to_row: dict[int, int]) -> None:
        self.root, self.trace, self.index_to_row = root, trace, index_to_row
        self.running: dict[str, Job] = {}

    def finished(self, name: str) -> Finished:
        job = self.running[name]
        code = job.finish(JOB_TIMEOUT_S)
        assert code == 0, f"{name}: exit {code}\n{job.tail(60)}"
        run_dir = self.root / name
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads(next(line for line in reversed(job.lines) if line.startswith("{")))
        return Finished(run_dir, "\n".join(job.lines), summary, rows, *self.groups(name))

    def groups(self, name: str) -> tuple[dict[int, list[list[float]]], dict[int, list[float]]]:
        """Each step's groups as the learner recorded them, with the scores the reward gave them,
        and (remax) each group's greedy baseline: the reward call for the prompt besides its
        samples' ones, whose score the learner recorded."""
        scores: dict[int, list[float]] = defaultdict(list)
        for line in self.trace.read_text().splitlines():
            call = json.loads(line)
            if call["job"] == name:
                scores[call["row"]].append(call["score"])
        out, baselines = {}, {}
        records = [
            json.loads(line) for line in (self.root / name / "trained_groups.jsonl").read_text().splitlines()
        ]
        for record in records:
            rows = [self.index_to_row[i] for i in record["prompts"]]
            assert list(record["groups"].values()) == [N] * PROMPTS, record
            if name == "remax":
                step_baselines = [record["baselines"][gid] for gid in record["groups"]]
                for r, baseline in zip(rows, step_baselines, strict=True):
                    assert baseline in scores[r], (record, r, scores[r])  # the reward service's score
                    scores[r].remove(baseline)  # the rest are the samples'
                baselines[record["step"]] = step_baselines
            else:
                assert not record["baselines"], record
            # A prompt is drawn once in these short runs, so its trace entries are its group's.
            assert all(len(scores[r]) == N for r in rows), (record, {r: scores[r] for r in rows})
            out[record["step"]] = [scores[r] for r in rows]
        return out, baselines


def write_job_data(source: Path, out: Path, job: str) -> Path:
    """The train split with the job's name in every row's extra_info (the trace tells jobs apart)."""
    rows = pq.read_table(source).to_pylist()
    for row in rows:
        row["extra_info"] = {**row["extra_info"], "job": job}
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def selected_jobs(items: list[pytest.Item]) -> list[str]:
    """The jobs this module's selected tests read (every job in a full run)."""
    wanted = set()
    for item in items:
        if item.module.__name__ == __name__:
            callspec = getattr(item, "callspec", None)
            wanted.add(callspec.params["estimator"] if callspec else "async")
    return [name for name in JOBS if name in wanted]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, request) -> Iterator[Jobs]:
    root = tmp_path_factory.mktemp("estimators")
    model = build_tiny_model(root / "model", build_tokenizer(), hidden_size=32, num_layers=2, seed=0)
    data = generate_arithmetic(
        root / "data", 0, train_size=64, val_size=8, min_terms=2, max_terms=2, max_operand=20, ops="+"
    )
    items = RLHFDataset(str(data["train"]), load_tokenizer(model), max_prompt_length=64).items
    reward, trace = root / "reward.py", root / "reward-calls.jsonl"
    reward.write_text(REWARD_FILE)
    common = [
        f"actor_rollout_ref.model.path={model}",
        f"data.val_files={data['test']}",
        f"custom_reward_function.path={reward}",
        f"custom_reward_function.reward_kwargs.trace={trace}",
    ]
    state = Jobs(root, trace, {item.index: item.row for item in items})
    selected = selected_jobs(request.session.items)
    with ProcessLauncher(root / "shared", stop_grace_s=10) as launcher:
        redis = launcher.start_redis()
        given = [f"rlmesh.redis_url={redis.url}"]
        reward_service = launcher.start_service(
            "reward", config_path=CPU_DEMO, overrides=[*common, *given, *free_port_overrides("reward")]
        )
        given.append(f"rlmesh.reward.addresses=['{reward_service.grpc_address}']")
        try:
            for name in selected:
                extra = JOBS[name]
                train = write_job_data(data["train"], root / f"train-{name}.parquet", name)
                state.running[name] = Job.start(
                    ["-c", str(CPU_DEMO), *common, *given, *job_overrides(name, train, root / name), *extra]
                )
            yield state
        finally:
            for job in state.running.values():
                if job.proc.poll() is None:
                    job.finish(JOB_TIMEOUT_S)  # (interrupts a job that does not end)


def job_overrides(name: str, train: Path, run_dir: Path) -> list[str]:
    return [
        f"rlmesh.run_id=est-{name}",
        f"data.train_files={train}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={PROMPTS * N}",
        f"actor_rollout_ref.rollout.response_length={LENGTH}",
        "actor_rollout_ref.rollout.ignore_eos=true",  # every response LENGTH tokens
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.optim.warmup_ratio=0.0",  # step 1 moves the policy
        "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
        "algorithm.use_kl_in_reward=false",
        f"algorithm.gamma={GAMMA}",
        "rlmesh.rollout.replicas=1",
        "rlmesh.control.enabled=false",
    ]


# ---------------------------------------------------------------- the estimators' formulas


def whiten(x: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit (unbiased) variance over every entry."""
    return (x - x.mean()) / torch.sqrt(x.var() + 1e-8)


def expected(
    estimator: str, groups: list[list[float]], baselines: list[float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) per sample and token, ``(samples, LENGTH)``, for one step's groups of
    scores (and, for remax, each group's greedy baseline score); every response LENGTH tokens
    long, the score on its last token."""
    s = torch.tensor(groups, dtype=torch.float64)  # (groups, N)
    n = s.shape[1]
    per_token = lambda a: a.reshape(-1, 1).expand(-1, LENGTH)  # noqa: E731
    if estimator == "rloo":  # the score minus the mean of the group's other scores
        adv = per_token(s - (s.sum(dim=1, keepdim=True) - s) / (n - 1))
        return adv, adv
    if estimator == "grpo":  # normalised within the group (sample std)
        adv = per_token((s - s.mean(dim=1, keepdim=True)) / (s.std(dim=1, keepdim=True) + 1e-6))
        return adv, adv
    if estimator == "reinforce_plus_plus":  # discounted reward-to-go, whitened over the batch
        returns = s.reshape(-1, 1) * GAMMA ** torch.arange(LENGTH - 1, -1, -1, dtype=torch.float64)
        return whiten(returns), returns
    if estimator == "reinforce_plus_plus_baseline":  # the group mean off, then whitened over the batch
        adv = whiten(per_token(s - s.mean(dim=1, keepdim=True)))
        return adv, adv
    if estimator == "remax":  # undiscounted reward-to-go (the score on every token) minus the baseline
        b = torch.tensor(baselines, dtype=torch.float64).reshape(-1, 1)  # (groups, 1)
        return per_token(s - b), per_token(s)
    raise AssertionError(estimator)


def job_algorithm(name: str) -> AlgorithmConfig:
    """The job's resolved ``algorithm`` section: what its learner hands the estimator."""
    keys = [*job_overrides(name, Path("train.parquet"), Path("run")), *JOBS[name]]
    return load_config(CPU_DEMO, keys).algorithm


def algo_per_token(
    estimator: str, groups: list[list[float]], baselines: list[float] | None, algorithm: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) ``(samples, LENGTH + PAD)`` from ``rlmesh.algo.compute_advantage`` on
    one step's batch as the learner lays it out: a row per sample, its score on its last response
    token, ``PAD`` masked positions after it, its group's uid as the index (remax: its group's
    baseline score), the job's ``gamma``, ``lam`` and GRPO normalisation."""
    s = torch.tensor(groups, dtype=torch.float32)  # (groups, N)
    rewards = torch.zeros(s.numel(), LENGTH + PAD)
    rewards[:, LENGTH - 1] = s.reshape(-1)
    mask = torch.zeros_like(rewards)
    mask[:, :LENGTH] = 1.0
    index = np.array([f"group-{g}" for g in range(s.shape[0]) for _ in range(s.shape[1])], dtype=object)
    reward_baselines = None
    if baselines is not None:
        reward_baselines = torch.tensor(baselines, dtype=torch.float32).repeat_interleave(s.shape[1])
    return compute_advantage(
        estimator,
        rewards,
        mask,
        index=index,
        reward_baselines=reward_baselines,
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
    )


def check_per_token(
    estimator: str, step: int, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """Every sample's value at every position is the formula's; nothing past a response."""
    for name, g, w in zip(("advantages", "returns"), got, want, strict=True):
        assert g.shape == (w.shape[0], LENGTH + PAD), (step, name, g.shape)
        torch.testing.assert_close(
            g[:, :LENGTH].double(),
            w,
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m, name=name: f"{estimator} step {step} {name}: {m}",
        )
        assert not g[:, LENGTH:].any(), (step, name, g[:, LENGTH:])


def check_advantages(estimator: str, done: Finished, algorithm: AlgorithmConfig) -> None:
    """Every step's logged advantage and return statistics are the estimator's, on its scores, and
    rlmesh's estimator gives that step's batch the formula's value at every sample and token."""
    assert sorted(done.groups) == list(range(1, len(done.rows) + 1))
    spread = []
    for row in done.rows:
        step = int(row["step"])
        assert row["response_length/min"] == row["response_length/max"] == LENGTH, row
        scores = [x for g in done.groups[step] for x in g]
        assert row["critic/score/mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-6), step
        baselines = done.baselines.get(step)
        adv, returns = expected(estimator, done.groups[step], baselines)
        for name, x in (("advantages", adv), ("returns", returns)):
            for stat, value in (("mean", x.mean()), ("max", x.max()), ("min", x.min())):
                key = f"critic/{name}/{stat}"
                assert row[key] == pytest.approx(float(value), abs=1e-4), (step, key, row[key], float(value))
        got = algo_per_token(estimator, done.groups[step], baselines, algorithm)
        check_per_token(estimator, step, got, (adv, returns))
        spread.append(row["critic/advantages/max"] - row["critic/advantages/min"])
    assert max(spread) > 0.1, spread  # the checks above compared something besides zeros


def check_run(done: Finished, steps: int) -> None:
    """Ran to its last step, one metrics row per step, no critic anywhere."""
    assert done.summary["steps"] == steps, done.output[-3000:]
    assert [int(r["step"]) for r in done.rows] == list(range(1, steps + 1))
    assert done.rows[-1]["training/policy_version"] == steps
    for row in done.rows:
        assert not [k for k in row if k.startswith(CRITIC_ONLY)], row
        assert "actor/pg_loss" in row and math.isfinite(row["actor/pg_loss"])
        assert row["training/dropped_stale"] == 0  # never more than max_staleness batches ahead


@pytest.mark.timeout(900)
@pytest.mark.parametrize("estimator", ESTIMATOR_JOBS)
def test_estimator_trains_on_its_own_advantages(jobs, estimator):
    done = jobs.finished(estimator)
    check_run(done, STEPS)
    check_advantages(estimator, done, job_algorithm(estimator))
    # Synchronous (max_staleness 0): every sample comes from the weights being trained.
    assert [r["training/staleness/max"] for r in done.rows] == [0.0] * STEPS


@pytest.mark.timeout(900)
def test_async_run_trains_one_version_behind_with_importance_weights(jobs):
    done = jobs.finished("async")
    check_run(done, ASYNC_STEPS)
    check_advantages("grpo", done, job_algorithm("async"))  # groups stay whole when sampled ahead
    rows = done.rows
    for row in rows:
        for key in ("rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_std",
                    "rollout_is_eff_sample_size", "logprob_abs_diff_mean"):  # fmt: skip
            assert math.isfinite(row[f"rollout_corr/{key}"]), (row["step"], key)
        # The collector drops what lags more than max_staleness.
        assert 0 <= row["training/staleness/min"] <= row["training/staleness/max"] <= 1, row
    # Step 1 trains version 0 on samples of version 0: on-policy by construction.
    assert rows[0]["training/staleness/max"] == 0
    stale = [r for r in rows if r["training/staleness/max"] == 1]
    assert stale, [r["training/staleness/max"] for r in rows]  # step 2's batch was sampled during step 1
    on_policy_diff = rows[0]["rollout_corr/logprob_abs_diff_mean"]
    for row in stale:
        # Samples of the previous weights: the learner's log-probs moved away from the sampler's,
        # and the IS weights (their ratio, before truncation) are no longer all 1.
        assert row["rollout_corr/logprob_abs_diff_mean"] > on_policy_diff, (row, on_policy_diff)
        assert row["rollout_corr/rollout_is_max"] > 1 or row["rollout_corr/rollout_is_min"] < 1, row
