"""benchmarks/bench_scale.py: a point publishes whole groups through a real Redis, the learner's
collector takes every one of them back, and the figures it records add up."""

import json
import sys

import pytest

from tests.support.repo import REPO

sys.path.insert(0, str(REPO))
from benchmarks.bench_scale import main, parse_points


def test_a_small_point_goes_through_redis_and_the_learners_collector(tmp_path):
    assert (
        main(["--points", "32x16,64x8", "--producers", "2", "--n", "4", "--signed", "--out", str(tmp_path)])
        == 0
    )
    (results,) = tmp_path.glob("*/results.json")
    record = json.loads(results.read_text())
    assert "token" not in record["args"] and record["args"]["signed"] is True
    first, second = record["points"]
    assert (first["trajectories"], first["response_tokens"], second["trajectories"]) == (32, 16, 64)
    # 32 trajectories of a 512-token prompt with ids of 3 bytes: at least 32 x 512 x 2 bytes
    assert first["stream_bytes"] > 32 * 512 * 2 and first["redis_commands"] > 32 / 16
    assert first["publish_s"] > 0 and first["collect_s"] > 0 and first["batch_tensor_bytes"] > 0


def test_a_point_is_trajectories_x_tokens():
    assert parse_points("1024x512,16x4") == [(1024, 512), (16, 4)]
    with pytest.raises(Exception, match=r"TRAJECTORIESxTOKENS, got '1024:512'"):
        parse_points("1024:512")
