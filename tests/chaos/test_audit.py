"""The exactly-once audit itself, on crafted ``trained_groups.jsonl`` files: a correct failover passes,
and each way a failover could fool a last-record-counts audit is refused, naming the step."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.jobs import Planned, audit_groups, prompt_digest

N = 2
BATCH = 3
STEPS = 6
_suffixes = itertools.count()


def prompt_ids(index: int) -> list[int]:
    """The made-up dataset's row ``index``, tokenized."""
    return [7, index, index * 3 % 11]


PLAN = {
    s: [Planned(i, prompt_digest(prompt_ids(i))) for i in range((s - 1) * BATCH, s * BATCH)]
    for s in range(1, STEPS + 1)
}


def record(step: int, incarnation: int, indices: list[int] | None = None) -> dict[str, Any]:
    """What a learner of ``incarnation`` writes for ``step``, trained on ``indices`` (the plan's if
    None), each group with N samples of its own row."""
    indices = [p.index for p in PLAN[step]] if indices is None else indices
    groups = [f"i{incarnation}:s{step}:d{i}:{next(_suffixes):08x}" for i in indices]
    return {
        "step": step,
        "incarnation": incarnation,
        "prompts": indices,
        "groups": {g: N for g in groups},
        "baselines": {},
        "prompt_digests": {g: prompt_digest(prompt_ids(i)) for g, i in zip(groups, indices, strict=True)},
    }


def run(incarnation: int, steps: range) -> list[dict[str, Any]]:
    return [record(s, incarnation) for s in steps]


def written(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "trained_groups.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def refused(tmp_path: Path, rows: list[dict[str, Any]], steps: int = STEPS) -> str:
    with pytest.raises(AssertionError) as raised:
        audit_groups(written(tmp_path, rows), {s: PLAN[s] for s in range(1, steps + 1)}, N)
    return str(raised.value)


def test_a_run_and_a_correct_failover_pass(tmp_path):
    audit_groups(written(tmp_path, run(1, range(1, STEPS + 1))), PLAN, N)
    # Learner 1 records 1..5 and dies (checkpoint of step 4); learner 2 resumes at 5, records 5 and 6
    # and dies before checkpointing 6; the same command again (a fresh Redis: incarnation 1 again)
    # resumes from 4 once more and finishes.
    rows = [*run(1, range(1, 6)), *run(2, range(5, 7)), *run(1, range(5, 7))]
    audit_groups(written(tmp_path, rows), PLAN, N)
    # A job killed after step 5 and started again: both learners are incarnation 1 of their Redis.
    audit_groups(written(tmp_path, [*run(1, range(1, 6)), *run(1, range(5, 7))]), PLAN, N)


def test_a_rolled_back_record_with_other_prompts_is_refused_though_its_redo_is_right(tmp_path):
    wrong = [p.index for p in PLAN[4]]
    rows = [*run(1, range(1, 3)), record(3, 1, wrong), *run(2, range(3, STEPS + 1))]
    message = refused(tmp_path, rows)
    assert "step 3 (incarnation 1) trained on prompts" in message


def test_a_step_one_learner_recorded_twice_with_other_prompts_is_refused(tmp_path):
    rows = [*run(1, range(1, 4)), record(3, 1, [p.index for p in PLAN[2]]), *run(1, range(4, STEPS + 1))]
    assert "step 3 (incarnation 1) trained on prompts" in refused(tmp_path, rows)


def test_a_step_one_learner_skipped_is_refused(tmp_path):
    rows = [*run(1, range(1, 3)), *run(1, range(4, STEPS + 1))]
    assert "step 4: incarnation 1 recorded it after step 2" in refused(tmp_path, rows)


def test_a_step_a_dead_learner_recorded_and_its_successor_never_redid_is_refused(tmp_path):
    # Learner 2 resumed from the checkpoint of step 3, redid step 4 and was stopped: step 5, which
    # learner 1 trained and no checkpoint covered, stands in no learner's weights.
    rows = [*run(1, range(1, 6)), *run(2, range(4, 5))]
    message = refused(tmp_path, rows, steps=5)
    assert "step 5: incarnation 1 recorded it, and incarnation 2 resumed at step 4" in message


def test_a_successor_that_resumed_past_every_standing_step_is_refused(tmp_path):
    rows = [*run(1, range(1, 4)), *run(2, range(5, STEPS + 1))]
    assert "step 5: incarnation 2 began at it, but step 4" in refused(tmp_path, rows)


def test_a_group_whose_prompt_ids_are_not_its_dataset_row_is_refused(tmp_path):
    rows = run(1, range(1, STEPS + 1))
    group = next(iter(rows[2]["prompt_digests"]))
    rows[2]["prompt_digests"][group] = prompt_digest([7, 99, 1])
    assert f"step 3 (incarnation 1): group {group} trained on prompt ids" in refused(tmp_path, rows)


def test_a_group_whose_samples_had_different_prompts_is_refused(tmp_path):
    rows = run(1, range(1, STEPS + 1))
    group = next(iter(rows[1]["prompt_digests"]))
    # The learner joins the digests of a group's samples when they differ.
    rows[1]["prompt_digests"][group] += "," + prompt_digest([7, 99, 1])
    assert "step 2 (incarnation 1): group" in refused(tmp_path, rows)


def test_a_record_without_prompt_digests_is_refused(tmp_path):
    rows = run(1, range(1, STEPS + 1))
    del rows[4]["prompt_digests"]
    assert "step 5 (incarnation 1): no prompt_digests" in refused(tmp_path, rows)


def test_a_group_trained_in_two_standing_steps_is_refused(tmp_path):
    # Across an epoch's end a row comes again (here row 2, in steps 1 and 2): its group of step 1
    # must not be trained on again in step 2.
    plan = {1: [Planned(i, prompt_digest(prompt_ids(i))) for i in (0, 1, 2)]}
    plan[2] = [Planned(i, prompt_digest(prompt_ids(i))) for i in (2, 3, 4)]
    rows = [record(1, 1, [0, 1, 2]), record(2, 1, [2, 3, 4])]
    again = next(g for g in rows[0]["groups"] if ":d2:" in g)
    gone = next(g for g in rows[1]["groups"] if ":d2:" in g)
    for key in ("groups", "prompt_digests"):
        rows[1][key] = {(again if g == gone else g): v for g, v in rows[1][key].items()}
    with pytest.raises(AssertionError, match=rf"groups trained on in two steps: {{'{again}': \[1, 2\]}}"):
        audit_groups(written(tmp_path, rows), plan, N)
