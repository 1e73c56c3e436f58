"""The demo's per-stage tokens/s, and make bench's per-step accounting: phases, counters, ceiling."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from rlmesh.job.report import (
    FAR_BELOW_CEILING,
    LEARNER_PHASES,
    command_calls,
    counter_deltas,
    far_below,
    metric_sum,
    phase_names,
    redis_info,
    served_share,
    stage_rates,
    step_phases,
)

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


# ----- make bench's per-step accounting -----

STEP = {
    "step": 3,
    "timing_s/step": 2.0,
    "timing_s/gen": 0.5,
    "timing_s/old_log_prob": 0.1,
    "timing_s/values": 0.1,
    "timing_s/adv": 0.01,
    "timing_s/update_critic": 0.6,
    "timing_s/update_actor": 0.5,
    "timing_s/push_weights": 0.04,
    "timing_start/gen": 1.0e9,
}


def test_a_step_splits_into_the_learners_phases_and_the_rest():
    parts = step_phases(STEP)
    assert list(parts) == ["wall", *(p for p in LEARNER_PHASES if p != "ref"), "other"]
    assert parts["wall"] == 2.0 and parts["gen"] == 0.5
    assert parts["other"] == pytest.approx(2.0 - 1.85)
    assert sum(v for k, v in parts.items() if k != "wall") == pytest.approx(parts["wall"])


def test_phases_some_steps_lack_and_phases_added_later_get_columns_of_their_own():
    # A colocated reference's forward (known), and a phase this code does not know yet.
    rows = [{**STEP, "timing_s/ref": 0.2, "timing_s/new": 0.1}, STEP]
    names = phase_names(rows)
    assert names == [*LEARNER_PHASES, "new"]  # in the order the learner runs them, unknown last
    assert phase_names([STEP]) == [p for p in LEARNER_PHASES if p != "ref"]
    with_ref, without = (step_phases(r, names) for r in rows)
    assert with_ref["ref"] == 0.2 and without["ref"] == 0.0 and without["new"] == 0.0
    assert with_ref["other"] == pytest.approx(without["other"] - 0.3)


def test_metric_sum_adds_the_samples_of_a_name_whose_labels_match():
    registry = CollectorRegistry()
    rpcs = Counter("rlmesh_rpc_requests", "", ["service", "method", "code"], registry=registry)
    rpcs.labels("reward", "/rlmesh.v1.Reward/Score", "OK").inc(3)
    rpcs.labels("reward", "/rlmesh.v1.Reward/Score", "UNAVAILABLE").inc()
    rpcs.labels("reward", "/rlmesh.v1.Reward/GetInfo", "OK").inc(7)
    sizes = Histogram("rlmesh_reward_batch_size", "", buckets=(1, 4, 64), registry=registry)
    for n in (4, 4, 64):
        sizes.observe(n)
    text = generate_latest(registry).decode()
    assert metric_sum(text, "rlmesh_rpc_requests_total", method="/rlmesh.v1.Reward/Score") == 4
    assert metric_sum(text, "rlmesh_rpc_requests_total", code="OK") == 10
    assert metric_sum(text, "rlmesh_rpc_requests_total", method="/nope") == 0
    assert metric_sum(text, "rlmesh_reward_batch_size_count") == 3  # calls
    assert metric_sum(text, "rlmesh_reward_batch_size_sum") == 72  # samples
    assert metric_sum(text, "rlmesh_absent_total") == 0


INFO = """# Stats
total_commands_processed:1234
total_reads_processed:800

# Commandstats
cmdstat_xadd:calls=64,usec=900,usec_per_call=14.06,rejected_calls=0,failed_calls=0
cmdstat_client|setname:calls=3,usec=2,usec_per_call=0.67,rejected_calls=0,failed_calls=0
cmdstat_evalsha:calls=128,usec=5000,usec_per_call=39.06,rejected_calls=0,failed_calls=1
"""


def test_redis_commandstats_give_calls_per_command():
    info = redis_info(INFO)
    assert info["total_reads_processed"] == "800" and "# Stats" not in info
    assert command_calls(info) == {"xadd": 64, "client|setname": 3, "evalsha": 128}


def test_counter_deltas_count_new_counters_from_zero_and_reset_ones_from_their_reset():
    before = {"redis/xadd": 64, "redis/evalsha": 128, "engine 0/tokens": 5000}
    after = {"redis/xadd": 128, "redis/evalsha": 128, "redis/xack": 2, "engine 0/tokens": 300}
    assert counter_deltas(before, after) == {
        "redis/xadd": 64,
        "redis/evalsha": 0,
        "redis/xack": 2,  # first called in this step
        "engine 0/tokens": 300,  # the engine restarted: its counters began again at 0
    }


def test_served_generation_against_the_ceiling_and_the_flag():
    rate, share = served_share(tokens=512, window_s=0.5, ceiling_tokens_per_s=4096)
    assert rate == 1024 and share == 0.25
    assert not far_below(share) and far_below(0.2) and far_below(0.5, threshold=0.6)
    assert far_below(FAR_BELOW_CEILING - 1e-9)
    assert served_share(100, 0.0, 4096) == (0.0, 0.0)  # no window: nothing to rate
