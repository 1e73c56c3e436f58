"""A reward's returned value read as (score, extras)."""

import pytest

from rlmesh.reward.values import MAX_REWARD_EXTRA_KEYS, NotAScore, read_score


def test_a_dict_gives_its_score_and_numeric_extras():
    score, extra = read_score({"score": 1, "acc": True, "pred": "7", "format": 0.5}, "f")
    assert score == 1.0
    assert extra == {"acc": 1.0, "format": 0.5}  # "pred" is a string: not a metric


def test_extras_stop_at_the_cap_keeping_the_first_names_in_sorted_order():
    value = {"score": 0.0, **{f"k{i:05d}": float(i) for i in range(10_000)}}
    _, extra = read_score(value, "f")
    assert list(extra) == [f"k{i:05d}" for i in range(MAX_REWARD_EXTRA_KEYS)]


def test_a_dict_without_score_is_refused_naming_its_keys():
    with pytest.raises(NotAScore, match=r"without a 'score' key .*acc"):
        read_score({"acc": 1.0}, "f")
