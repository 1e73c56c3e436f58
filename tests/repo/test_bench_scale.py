"""benchmarks/bench_scale.py: a point publishes whole groups through a real Redis, the learner's
collector takes every one of them back, a push reaches every simulated engine, a fleet of whole
replicas finishes tasks, and the figures it records add up."""

import json
import sys

import pytest

from tests.support.repo import REPO

sys.path.insert(0, str(REPO))
from benchmarks.bench_scale import main, parse_points


def test_a_small_point_goes_through_redis_and_the_collector_and_a_push_reaches_the_engines(tmp_path):
    argv = ["--points", "32x16,64x8", "--producers", "2", "--n", "4", "--signed", "--push", "2x4"]
    argv += ["--replicas", "2", "--fleet-idle-s", "2", "--fleet-load-s", "6"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    (results,) = tmp_path.glob("*/results.json")
    record = json.loads(results.read_text())
    assert "token" not in record["args"] and record["args"]["signed"] is True
    first, second = record["points"]
    assert (first["trajectories"], first["response_tokens"], second["trajectories"]) == (32, 16, 64)
    # 32 trajectories of a 512-token prompt with ids of 3 bytes: at least 32 x 512 x 2 bytes
    assert first["stream_bytes"] > 32 * 512 * 2 and first["redis_commands"] > 32 / 16
    assert first["publish_s"] > 0 and first["collect_s"] > 0 and first["batch_tensor_bytes"] > 0
    (push,) = record["pushes"]  # every engine took it (the benchmark stops on a failed or wrong push)
    assert (push["engines"], push["weight_bytes"], push["bytes_moved"]) == (2, 4 << 20, 8 << 20)
    (fleet,) = record["fleets"]
    assert fleet["replicas"] == 2 and fleet["tasks_per_s"] > 0 and fleet["trajectories_per_s"] > 0
    # Two replicas heartbeat and poll for tasks even when idle; loaded, they claim and publish more.
    assert 0 < fleet["idle"]["redis_commands_per_s"] < fleet["loaded"]["redis_commands_per_s"]
    assert fleet["loaded"]["cpu_share"]["replica"] > 0 and fleet["loaded"]["cpu_share"]["engine"] > 0


def test_a_point_is_trajectories_x_tokens():
    assert parse_points("1024x512,16x4") == [(1024, 512), (16, 4)]
    with pytest.raises(Exception, match=r"TRAJECTORIESxTOKENS, got '1024:512'"):
        parse_points("1024:512")


def test_with_arrive_s_the_learner_collects_while_the_groups_arrive(tmp_path):
    argv = [
        "--points",
        "64x16",
        "--producers",
        "2",
        "--n",
        "4",
        "--arrive-s",
        "1",
        "--push",
        "",
        "--replicas",
        "",
    ]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    (results,) = tmp_path.glob("*/results.json")
    (point,) = json.loads(results.read_text())["points"]
    # Every trajectory was collected (the benchmark stops otherwise), its rows written as it came.
    assert point["place_s"] > 0 and point["finish_s"] > 0 and point["batch_tensor_bytes"] > 0
    assert point["trajectories"] == 64 and "after_last_s" in point
    # The learner read them while they were published: Redis sent at least their bytes out.
    assert point["redis_out_bytes"] >= point["stream_bytes"] and point["redis_step_memory"] is None
