"""The demo's per-stage tokens/s."""

import pytest

from rlmesh.job.report import stage_rates

ROWS = [
    {
        "step": s,
        "timing_s/step": 2.0,
        "timing_s/gen": 0.01,
        "training/tokens": 1000,
        "training/response_tokens": 100,
        "timing_s/old_log_prob": 0.1,
        "timing_s/values": 0.1,
        "timing_s/update_actor": 0.4,
        "timing_s/update_critic": 0.6,
    }
    for s in (1, 2)
]


def test_generation_comes_from_the_engines_own_counters():
    # Generation ran ahead (asynchronous): the learner barely waited, which says nothing of speed.
    rates = stage_rates(
        ROWS, [{"tokens_generated": 3000, "busy_s": 2.0}, {"tokens_generated": 1000, "busy_s": 2.0}]
    )
    assert rates["generate_tokens_per_s"] == pytest.approx(1000.0)
    assert rates["learner_update_tokens_per_s"] == pytest.approx(2000 / 2.0)
    assert rates["step_tokens_per_s"] == pytest.approx(2000 / 4.0)


def test_without_engine_counters_the_learners_wait_is_used():
    assert stage_rates(ROWS)["generate_tokens_per_s"] == pytest.approx(200 / 0.02)
