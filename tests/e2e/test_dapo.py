"""DAPO as verl users run it, end to end: ``rlmesh train`` (its own Redis, reward service, rollout
replica and learner, each an OS process) with GRPO, dynamic sampling (``algorithm.filter_groups``
on ``acc``) and the dapo reward manager's overlong penalty, in verl's own key spellings.

The reward is the user's function: every response to an even row of the data scores 0 (a group that
teaches nothing, always dropped), a response to an odd row scores the parity of its characters' code
points (0 or 1, so an odd row's group is mixed most of the time). The function returns a number, so
the dapo manager records it as ``acc``; it traces every call. The test reads back what the learner
recorded (``trained_groups.jsonl``: the groups trained and the groups dropped, per step) and logged
(``metrics.jsonl``), and checks them against the trace: only mixed groups trained, the uniform ones
dropped and replaced by the next prompts of the data (verl's ``num_gen_batches`` > 1), every prompt
drawn either trained or dropped, once; and the sequence scores trained on carry the overlong
penalty. The buffer spans the whole response limit, so the penalty is linear in the length for every
response and the step's mean score follows from the mean raw score and the mean response length.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

from rlmesh.config import load_config
from rlmesh.data import PromptCursor, RLHFDataset, generate_arithmetic
from rlmesh.job.preflight import DRY_ROWS
from rlmesh.models import build_tiny_model, build_tokenizer, load_tokenizer
from tests.support.jobs import Job
from tests.support.repo import CPU_DEMO

STEPS, PROMPTS, N, LENGTH = 3, 4, 4, 6  # steps, prompts per step, samples per prompt, response limit
FACTOR = 0.5  # the overlong penalty at the response limit
JOB_TIMEOUT_S = 400
# The trace's first lines: the pre-flight calls the reward on the first train rows, twice each,
# before the job starts; they score no group.
DRY_CALLS = 2 * DRY_ROWS

REWARD_FILE = '''"""A test's own reward: 0 for an even row, else the parity of the code points; traced."""

import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None, trace=None):
    row = extra_info["index"]
    score = 0.0 if row % 2 == 0 else float(sum(map(ord, solution_str)) % 2)
    with open(trace, "a") as f:
        f.write(json.dumps({"row": row, "score": score}) + "\\n")
    return score
'''


def verl_overlong_reward(length: int) -> float:
    """verl's DAPORewardManager with max_resp_len = LENGTH and overlong_buffer.len = LENGTH."""
    expected_len = LENGTH - LENGTH
    return min(-(length - expected_len) / LENGTH * FACTOR, 0.0)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("dapo")
    model = build_tiny_model(root / "model", build_tokenizer(), hidden_size=32, num_layers=2, seed=0)
    data = generate_arithmetic(
        root / "data", 0, train_size=64, val_size=8, min_terms=2, max_terms=2, max_operand=20, ops="+"
    )
    reward, trace, run_dir = root / "reward.py", root / "reward-calls.jsonl", root / "run"
    reward.write_text(REWARD_FILE)
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data['train']}",
        f"data.val_files={data['test']}",
        f"custom_reward_function.path={reward}",
        f"custom_reward_function.reward_kwargs.trace={trace}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "data.seed=7",
        f"data.train_batch_size={PROMPTS}",
        f"data.max_response_length={LENGTH}",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={PROMPTS * N}",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "rlmesh.rollout.replicas=1",
        "rlmesh.control.enabled=false",
        # verl's DAPO keys: the recipe's dynamic sampling, the main trainer's reward_kwargs spelling.
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=20",
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        f"+reward_model.reward_kwargs.overlong_buffer_cfg.len={LENGTH}",
        f"+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor={FACTOR}",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=True",
        f"+reward_model.reward_kwargs.max_resp_len={LENGTH}",
    ]
    job = Job.start(["-c", str(CPU_DEMO), *overrides])
    code = job.finish(JOB_TIMEOUT_S)
    assert code == 0, f"exit {code}\n{job.tail(60)}"
    cfg = load_config(str(CPU_DEMO), overrides, warn=False)
    dataset = RLHFDataset.from_config(cfg.data, load_tokenizer(model), split="train")
    return run_dir, trace, dataset, PromptCursor.from_config(cfg.data, dataset)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(600)
def test_dapo_trains_on_mixed_groups_refills_and_penalises_length(finished):
    run_dir, trace, dataset, cursor = finished
    records = read_jsonl(run_dir / "trained_groups.jsonl")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    row_of = {item.index: item.row for item in dataset.items}
    scores: dict[int, list[float]] = defaultdict(list)
    for call in read_jsonl(trace)[DRY_CALLS:]:
        scores[call["row"]].append(call["score"])

    def group_scores(prompt: int) -> list[float]:
        found = scores[row_of[prompt]]
        assert len(found) == N, (prompt, found)  # a prompt is drawn once in this short run
        return found

    drawn = []
    for record, metrics in zip(records, rows, strict=True):
        step = record["step"]
        trained, dropped = record["prompts"], record["filtered_prompts"]
        assert list(record["groups"].values()) == [N] * PROMPTS, record
        assert list(record["filtered"].values()) == [N] * len(dropped), record
        # verl's rule on acc (the raw score): kept groups vary, dropped ones do not.
        assert all(len(set(group_scores(p))) > 1 for p in trained), step
        assert all(len(set(group_scores(p))) == 1 for p in dropped), step
        # One prompt drawn in place of each dropped group: verl's generation batches of PROMPTS.
        assert metrics["train/num_gen_batches"] == math.ceil((PROMPTS + len(dropped)) / PROMPTS), step
        assert metrics["training/filter_groups/evicted_samples"] == len(dropped), step
        assert metrics["training/filter_groups/kept_groups"] == PROMPTS, step
        drawn += trained + dropped
        # The sequence scores trained on: the raw score plus the overlong penalty, linear in the length
        # here, so its step mean is the penalty of the step's mean response length.
        raw = [s for p in trained for s in group_scores(p)]
        mean_length = metrics["response_length/mean"]
        penalty = verl_overlong_reward(mean_length)
        assert penalty < 0
        assert metrics["critic/score/mean"] == pytest.approx(sum(raw) / len(raw) + penalty, abs=1e-5), step
    assert max(r["train/num_gen_batches"] for r in rows) > 1  # groups were dropped and replaced
    # Every prompt the data cursor drew was trained on or dropped, once; none lost, none twice.
    assert sorted(drawn) == sorted(dataset[i].index for i in cursor.next_indices(len(drawn)))
    assert len(set(drawn)) == len(drawn)
