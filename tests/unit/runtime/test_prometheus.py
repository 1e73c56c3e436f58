"""The services' Prometheus series render exactly as they did before ``MetricSet`` (names, help,
types, labels, buckets): dashboards and alert rules read them. Texts captured from the old classes."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from rlmesh.reference.metrics import ReferenceMetrics
from rlmesh.reward.metrics import RewardMetrics
from rlmesh.runtime.busy import BusyTracker
from rlmesh.runtime.prometheus import MetricSet

REWARD_TEXT = """\
# HELP rlmesh_reward_samples_total samples scored (with or without error), by function
# TYPE rlmesh_reward_samples_total counter
rlmesh_reward_samples_total{function="gsm8k"} 3.0
# HELP rlmesh_reward_sample_errors_total samples that could not be scored, by reason and function
# TYPE rlmesh_reward_sample_errors_total counter
rlmesh_reward_sample_errors_total{function="gsm8k",reason="timeout"} 1.0
# HELP rlmesh_reward_score scores of samples scored without error
# TYPE rlmesh_reward_score histogram
rlmesh_reward_score_bucket{function="gsm8k",le="-10.0"} 0.0
rlmesh_reward_score_bucket{function="gsm8k",le="-5.0"} 0.0
rlmesh_reward_score_bucket{function="gsm8k",le="-2.0"} 0.0
rlmesh_reward_score_bucket{function="gsm8k",le="-1.0"} 0.0
rlmesh_reward_score_bucket{function="gsm8k",le="-0.5"} 0.0
rlmesh_reward_score_bucket{function="gsm8k",le="-0.1"} 0.0
rlmesh_reward_score_bucket{function="gsm8k",le="0.0"} 1.0
rlmesh_reward_score_bucket{function="gsm8k",le="0.1"} 1.0
rlmesh_reward_score_bucket{function="gsm8k",le="0.5"} 1.0
rlmesh_reward_score_bucket{function="gsm8k",le="1.0"} 2.0
rlmesh_reward_score_bucket{function="gsm8k",le="2.0"} 2.0
rlmesh_reward_score_bucket{function="gsm8k",le="5.0"} 2.0
rlmesh_reward_score_bucket{function="gsm8k",le="10.0"} 2.0
rlmesh_reward_score_bucket{function="gsm8k",le="+Inf"} 2.0
rlmesh_reward_score_count{function="gsm8k"} 2.0
# HELP rlmesh_reward_function_seconds time one reward function call took
# TYPE rlmesh_reward_function_seconds histogram
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="0.0001"} 0.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="0.001"} 0.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="0.005"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="0.01"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="0.05"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="0.1"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="0.5"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="1.0"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="5.0"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="10.0"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="30.0"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="60.0"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="300.0"} 1.0
rlmesh_reward_function_seconds_bucket{function="gsm8k",le="+Inf"} 1.0
rlmesh_reward_function_seconds_count{function="gsm8k"} 1.0
rlmesh_reward_function_seconds_sum{function="gsm8k"} 0.002
# HELP rlmesh_reward_batch_size samples per scoring call
# TYPE rlmesh_reward_batch_size histogram
rlmesh_reward_batch_size_bucket{le="1.0"} 0.0
rlmesh_reward_batch_size_bucket{le="2.0"} 0.0
rlmesh_reward_batch_size_bucket{le="4.0"} 1.0
rlmesh_reward_batch_size_bucket{le="8.0"} 1.0
rlmesh_reward_batch_size_bucket{le="16.0"} 1.0
rlmesh_reward_batch_size_bucket{le="32.0"} 1.0
rlmesh_reward_batch_size_bucket{le="64.0"} 1.0
rlmesh_reward_batch_size_bucket{le="128.0"} 1.0
rlmesh_reward_batch_size_bucket{le="256.0"} 1.0
rlmesh_reward_batch_size_bucket{le="512.0"} 1.0
rlmesh_reward_batch_size_bucket{le="1024.0"} 1.0
rlmesh_reward_batch_size_bucket{le="2048.0"} 1.0
rlmesh_reward_batch_size_bucket{le="4096.0"} 1.0
rlmesh_reward_batch_size_bucket{le="+Inf"} 1.0
rlmesh_reward_batch_size_count 1.0
rlmesh_reward_batch_size_sum 3.0
# HELP rlmesh_reward_calls_waiting scoring calls waiting for the concurrency limit
# TYPE rlmesh_reward_calls_waiting gauge
rlmesh_reward_calls_waiting 2.0
"""

REFERENCE_TEXT = """\
# HELP rlmesh_reference_samples_total samples answered
# TYPE rlmesh_reference_samples_total counter
rlmesh_reference_samples_total 4.0
# HELP rlmesh_reference_tokens_total prompt + response tokens of samples answered
# TYPE rlmesh_reference_tokens_total counter
rlmesh_reference_tokens_total 40.0
# HELP rlmesh_reference_padded_tokens_total tokens forwarded, padding included
# TYPE rlmesh_reference_padded_tokens_total counter
rlmesh_reference_padded_tokens_total 48.0
# HELP rlmesh_reference_batch_size samples per LogProbs call answered (its count: the calls)
# TYPE rlmesh_reference_batch_size histogram
rlmesh_reference_batch_size_bucket{le="1.0"} 0.0
rlmesh_reference_batch_size_bucket{le="2.0"} 0.0
rlmesh_reference_batch_size_bucket{le="4.0"} 1.0
rlmesh_reference_batch_size_bucket{le="8.0"} 1.0
rlmesh_reference_batch_size_bucket{le="16.0"} 1.0
rlmesh_reference_batch_size_bucket{le="32.0"} 1.0
rlmesh_reference_batch_size_bucket{le="64.0"} 1.0
rlmesh_reference_batch_size_bucket{le="128.0"} 1.0
rlmesh_reference_batch_size_bucket{le="256.0"} 1.0
rlmesh_reference_batch_size_bucket{le="512.0"} 1.0
rlmesh_reference_batch_size_bucket{le="1024.0"} 1.0
rlmesh_reference_batch_size_bucket{le="2048.0"} 1.0
rlmesh_reference_batch_size_bucket{le="4096.0"} 1.0
rlmesh_reference_batch_size_bucket{le="+Inf"} 1.0
rlmesh_reference_batch_size_count 1.0
rlmesh_reference_batch_size_sum 4.0
# HELP rlmesh_reference_micro_batches_total forward passes
# TYPE rlmesh_reference_micro_batches_total counter
rlmesh_reference_micro_batches_total 1.0
# HELP rlmesh_reference_compute_seconds time to compute one call's log-probs
# TYPE rlmesh_reference_compute_seconds histogram
rlmesh_reference_compute_seconds_bucket{le="0.01"} 0.0
rlmesh_reference_compute_seconds_bucket{le="0.05"} 0.0
rlmesh_reference_compute_seconds_bucket{le="0.1"} 0.0
rlmesh_reference_compute_seconds_bucket{le="0.25"} 0.0
rlmesh_reference_compute_seconds_bucket{le="0.5"} 0.0
rlmesh_reference_compute_seconds_bucket{le="1.0"} 1.0
rlmesh_reference_compute_seconds_bucket{le="2.5"} 1.0
rlmesh_reference_compute_seconds_bucket{le="5.0"} 1.0
rlmesh_reference_compute_seconds_bucket{le="10.0"} 1.0
rlmesh_reference_compute_seconds_bucket{le="30.0"} 1.0
rlmesh_reference_compute_seconds_bucket{le="60.0"} 1.0
rlmesh_reference_compute_seconds_bucket{le="120.0"} 1.0
rlmesh_reference_compute_seconds_bucket{le="300.0"} 1.0
rlmesh_reference_compute_seconds_bucket{le="+Inf"} 1.0
rlmesh_reference_compute_seconds_count 1.0
rlmesh_reference_compute_seconds_sum 0.7
# HELP rlmesh_reference_busy_seconds_total wall seconds with at least one forward running
# TYPE rlmesh_reference_busy_seconds_total counter
rlmesh_reference_busy_seconds_total 0.0
"""


def exposition(registry: CollectorRegistry) -> str:
    """The /metrics text without the ``_created`` samples, which carry the wall-clock time."""
    lines = generate_latest(registry).decode().splitlines()
    return "".join(line + "\n" for line in lines if "_created" not in line)


def test_reward_series_render_as_before():
    registry = CollectorRegistry()
    metrics = RewardMetrics(registry)
    metrics.samples.labels("gsm8k").inc(3)
    metrics.errors.labels("timeout", "gsm8k").inc()
    metrics.scores.labels("gsm8k").observe(1.0)
    metrics.scores.labels("gsm8k").observe(0.0)
    metrics.function_seconds.labels("gsm8k").observe(0.002)
    metrics.batch_size.observe(3)
    metrics.waiting.set(2)
    assert exposition(registry) == REWARD_TEXT


def test_reference_series_render_as_before():
    registry = CollectorRegistry()
    metrics = ReferenceMetrics(registry, BusyTracker(clock=lambda: 100.0))
    metrics.samples.inc(4)
    metrics.tokens.inc(40)
    metrics.padded_tokens.inc(48)
    metrics.batch_size.observe(4)
    metrics.micro_batches.inc()
    metrics.compute_seconds.observe(0.7)
    assert exposition(registry) == REFERENCE_TEXT


def test_zero_makes_each_listed_series_at_zero_and_no_other():
    registry = CollectorRegistry()
    series = MetricSet(registry)
    series.counter("t_calls", "calls", ["dependency"], zero=["engine", "reward"])
    series.gauge("t_open", "open", ["source", "outcome"], zero=[("disk", "ok")])
    assert registry.get_sample_value("t_calls_total", {"dependency": "engine"}) == 0
    assert registry.get_sample_value("t_calls_total", {"dependency": "reward"}) == 0
    assert registry.get_sample_value("t_calls_total", {"dependency": "reference"}) is None
    assert registry.get_sample_value("t_open", {"source": "disk", "outcome": "ok"}) == 0
    assert registry.get_sample_value("t_open", {"source": "disk", "outcome": "failed"}) is None


def test_no_registry_registers_nowhere():
    # Twice the same names: a registry (the default one included) would refuse the second set.
    for _ in range(2):
        series = MetricSet(None)
        series.counter("t_unregistered", "x").inc()
        series.histogram("t_unregistered_seconds", "x", buckets=(1.0,)).observe(0.5)
    assert REGISTRY.get_sample_value("t_unregistered_total") is None
