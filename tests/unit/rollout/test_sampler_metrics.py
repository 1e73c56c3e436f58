"""The sampler's metrics that alerts and the dashboard read: busy time over overlapping generate
calls, the engine's GPUs, the replica's weight version and pause state, and labelled series that
exist at 0 before their first event (so an alert's increase() sees that event)."""

from prometheus_client import CollectorRegistry, Counter

from rlmesh.queue import RunKeys, connect, prompt_queue, trajectory_queue
from rlmesh.rollout.resilience import CircuitBreaker
from rlmesh.rollout.sampler import BusyClock, SamplerLoop, SamplerSettings, engine_gpus


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_busy_clock_counts_wall_time_with_any_span_open_once():
    counter = Counter("busy", "busy seconds", registry=CollectorRegistry())
    clock = FakeClock()
    busy = BusyClock(counter, clock)
    clock.now += 5  # idle: not counted
    with busy:
        clock.now += 1
        with busy:  # overlapping spans count once
            clock.now += 2
        clock.now += 1
    clock.now += 10  # idle again
    with busy:
        clock.now += 0.5
    assert counter._value.get() == 4.5


def test_engine_gpus_from_server_info():
    assert engine_gpus({"engine": "embedded", "busy_s": 3.0}) == 0
    assert engine_gpus({"tp_size": 4, "dp_size": 1, "device": "cuda"}) == 4
    assert engine_gpus({"tp_size": 2, "dp_size": 2, "pp_size": None}) == 4  # SGLang's device unset: GPUs
    assert engine_gpus({"tp_size": 2, "device": "cpu"}) == 0  # SGLang's CPU backend


def sampler(registry):
    redis = connect("redis://127.0.0.1:1/0")  # never used: the client connects on first command
    keys = RunKeys("unit")
    return SamplerLoop(
        prompts=prompt_queue(redis, keys, "r1"),
        trajectories=trajectory_queue(redis, keys, "r1"),
        engine=None,
        score=None,
        ref_logprobs=None,
        settings=SamplerSettings(replica_id="r1"),
        reward_breaker=CircuitBreaker("reward"),
        reference_breaker=CircuitBreaker("reference"),
        registry=registry,
    )


async def test_series_alerts_read_exist_from_the_start():
    registry = CollectorRegistry()
    loop = sampler(registry)
    value = registry.get_sample_value
    for outcome in ("done", "failed", "interrupted"):
        assert value("rlmesh_rollout_tasks_total", {"outcome": outcome}) == 0
    for dependency in ("engine", "reward", "reference", "trajectory_stream"):
        assert value("rlmesh_rollout_dependency_retries_total", {"dependency": dependency}) == 0
    for dependency in ("engine", "reward", "reference"):
        assert value("rlmesh_rollout_breaker_open", {"dependency": dependency}) == 0
    assert value("rlmesh_rollout_generating_seconds_total") == 0
    assert value("rlmesh_rollout_engine_gpus") == 0
    # The run's queue gauges, found from the prompt stream's name.
    assert loop.queue_gauges is not None
    assert value("rlmesh_queue_length", {"stream": "dead"}) == 0
    assert value("rlmesh_replicas_registered") == 0


async def test_weight_version_and_pause_are_read_at_scrape_time():
    registry = CollectorRegistry()
    loop = sampler(registry)
    loop.policy_version = 7
    assert registry.get_sample_value("rlmesh_rollout_policy_version") == 7
    assert registry.get_sample_value("rlmesh_rollout_paused") == 0
    await loop.pause()
    assert registry.get_sample_value("rlmesh_rollout_paused") == 1
    loop.resume()
    assert registry.get_sample_value("rlmesh_rollout_paused") == 0
