"""Where step metrics go: every finite value to metrics.jsonl and Prometheus, timestamps to the file only."""

import json

from prometheus_client import CollectorRegistry

from rlmesh.learner.run.sinks import MetricsSinks


def test_phase_timestamps_go_to_the_file_only_and_non_finite_values_nowhere(tmp_path, capsys):
    registry = CollectorRegistry()
    sinks = MetricsSinks(
        ["console"], jsonl_path=tmp_path / "metrics.jsonl", registry=registry, project="p", experiment="e"
    )
    sinks.log(
        3,
        {
            "timing_s/step": 1.5,
            "timing_start/step": 1.7e9,
            "actor/pg_loss": float("nan"),
            "critic/score/mean": 0.25,
        },
    )
    sinks.close()
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 3 and row["timing_s/step"] == 1.5 and row["timing_start/step"] == 1.7e9
    assert "actor/pg_loss" not in row  # NaN is not written: JSON has no NaN
    assert registry.get_sample_value("rlmesh_learner_timing_s_step") == 1.5
    assert registry.get_sample_value("rlmesh_learner_critic_score_mean") == 0.25
    assert registry.get_sample_value("rlmesh_learner_timing_start_step") is None
    assert registry.get_sample_value("rlmesh_learner_actor_pg_loss") is None
    out = capsys.readouterr().out
    assert "step 3:" in out and "score 0.25" in out and "s 1.5" in out


def test_two_metrics_with_one_prometheus_name_keep_the_first_gauge_and_log_both(tmp_path, caplog):
    registry = CollectorRegistry()
    sinks = MetricsSinks(
        [], jsonl_path=tmp_path / "metrics.jsonl", registry=registry, project="p", experiment="e"
    )
    # Data sources "a.b" and "a_b" give one gauge name; the second must not crash the step.
    sinks.log(1, {"val/score/a.b": 0.5, "val/score/a_b": 0.25})
    sinks.log(2, {"val/score/a.b": 0.75, "val/score/a_b": 0.125})
    assert registry.get_sample_value("rlmesh_learner_val_score_a_b") == 0.75
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["val/score/a_b"] == 0.125
    warnings = [r for r in caplog.records if "val/score/a_b" in r.getMessage()]
    assert len(warnings) == 1
