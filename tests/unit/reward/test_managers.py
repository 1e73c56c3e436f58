"""verl's reward managers in the reward service: the dapo manager's overlong penalty (verl's formula,
recomputed here) and extras, the naive manager left as it was, and the keys that configure them in
verl's two spellings."""

from __future__ import annotations

import asyncio

import pytest

from rlmesh.config import ConfigError, load_config
from rlmesh.reward.function_loader import RewardFunction, RewardFunctionLoadError
from rlmesh.reward.managers import OverlongPenalty, RewardManager, overlong_reward, reward_manager_from_config
from rlmesh.reward.scorer import RewardScorer
from rlmesh.v1 import reward_pb2

MAX_LEN, BUFFER, FACTOR = 20, 8, 1.5


def verl_overlong_reward(
    valid_response_length: int, max_resp_len: int, buffer_len: int, factor: float
) -> float:
    """verl's DAPORewardManager, step by step."""
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    penalty = -exceed_len / buffer_len * factor
    return penalty if penalty < 0 else 0.0


def test_overlong_reward_is_verl_s_around_the_buffer():
    lengths = range(0, MAX_LEN + 3)  # below, across and past the buffer (a longer one cannot come back)
    got = [overlong_reward(n, MAX_LEN, BUFFER, FACTOR) for n in lengths]
    assert got == pytest.approx([verl_overlong_reward(n, MAX_LEN, BUFFER, FACTOR) for n in lengths])
    # Zero up to max - buffer, -factor at the limit, linear in between.
    assert got[MAX_LEN - BUFFER] == 0 and got[MAX_LEN - BUFFER - 1] == 0
    assert got[MAX_LEN] == pytest.approx(-FACTOR)
    assert got[MAX_LEN - BUFFER + 2] == pytest.approx(-2 / BUFFER * FACTOR)


def fn(f):
    return RewardFunction(name="test:fn", fn=f, is_async=False)


def number(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


def as_dict(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str == ground_truth
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": "text extras are dropped"}


def sample(uid, response, truth, length):
    return reward_pb2.RewardSample(
        uid=uid, response_text=response, ground_truth=truth, data_source="t", response_ids=[5] * length
    )


def score(function, manager, samples):
    scorer = RewardScorer(fn(function), manager=manager)
    try:
        return asyncio.run(scorer.score(samples))
    finally:
        scorer.close()


LENGTHS = (3, MAX_LEN - BUFFER, MAX_LEN - BUFFER + 1, MAX_LEN - 2, MAX_LEN)


@pytest.mark.parametrize("log", [False, True])
def test_dapo_adds_the_penalty_to_a_number_and_records_acc(log):
    dapo = RewardManager("dapo", OverlongPenalty(MAX_LEN, BUFFER, FACTOR, log))
    samples = [sample(f"u{n}", "42" if n % 2 else "7", "42", n) for n in LENGTHS]
    results = score(number, dapo, samples)
    for s, r in zip(samples, results, strict=True):
        raw = float(s.response_text == s.ground_truth)
        penalty = verl_overlong_reward(len(s.response_ids), MAX_LEN, BUFFER, FACTOR)
        assert r.score == pytest.approx(raw + penalty), s.uid
        expected = {"acc": raw}
        if log:
            expected |= {"overlong_reward": pytest.approx(penalty), "overlong": float(penalty < 0)}
        assert dict(r.extra) == expected, s.uid
    assert any(r.score < 0 for r in results)  # some were penalised


def test_dapo_keeps_every_key_of_a_dict_the_score_too():
    dapo = RewardManager("dapo", OverlongPenalty(MAX_LEN, BUFFER, FACTOR, True))
    samples = [sample("right", "42", "42", MAX_LEN), sample("wrong", "7", "42", 2)]
    right, wrong = score(as_dict, dapo, samples)
    penalty = verl_overlong_reward(MAX_LEN, MAX_LEN, BUFFER, FACTOR)
    assert right.score == pytest.approx(1.0 + penalty)
    assert dict(right.extra) == {
        "score": 1.0,
        "acc": 1.0,
        "overlong_reward": pytest.approx(penalty),
        "overlong": 1.0,
    }
    assert wrong.score == -1.0
    assert dict(wrong.extra) == {"score": -1.0, "acc": 0.0, "overlong_reward": 0.0, "overlong": 0.0}


def test_dapo_without_the_buffer_and_naive_leave_the_score_alone():
    samples = [sample("long", "42", "42", MAX_LEN)]
    (plain,) = score(number, RewardManager("dapo"), samples)
    assert plain.score == 1.0 and dict(plain.extra) == {"acc": 1.0}
    (naive,) = score(as_dict, RewardManager(), samples)
    assert naive.score == 1.0 and dict(naive.extra) == {"acc": 1.0}  # as before: no score key added


RECIPE = [  # verl's recipe/dapo spelling
    "reward_model.reward_manager=dapo",
    "reward_model.overlong_buffer.enable=True",
    "reward_model.overlong_buffer.len=128",
    "reward_model.overlong_buffer.penalty_factor=1.0",
    "data.max_response_length=2048",
]
MAIN_TRAINER = [  # verl's main trainer spelling (examples/*, reward_kwargs)
    "reward_model.reward_manager=dapo",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=128",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
    "+reward_model.reward_kwargs.max_resp_len=2048",
]


def test_both_spellings_configure_the_same_manager():
    expected = RewardManager("dapo", OverlongPenalty(2048, 128, 1.0, False))
    assert reward_manager_from_config(load_config(None, RECIPE)) == expected
    assert reward_manager_from_config(load_config(None, MAIN_TRAINER)) == expected
    # The main trainer's max_resp_len may be left out: data.max_response_length, as the recipe does.
    no_limit = [k for k in MAIN_TRAINER if "max_resp_len" not in k] + ["data.max_response_length=2048"]
    assert reward_manager_from_config(load_config(None, no_limit)) == expected
    assert reward_manager_from_config(load_config(None, [])) == RewardManager("naive")
    assert (
        reward_manager_from_config(load_config(None, ["reward_model.reward_manager=null"])) == RewardManager()
    )


def test_a_buffer_longer_than_the_limit_does_not_start():
    cfg = load_config(None, [*RECIPE, "data.max_response_length=64"])
    with pytest.raises(
        RewardFunctionLoadError, match=r"len \(128\) must not exceed the response limit .*\(64"
    ):
        reward_manager_from_config(cfg)
    with pytest.raises(ConfigError, match=r"max_resp_len \(64\) must be at least"):
        load_config(None, [*MAIN_TRAINER, "+reward_model.reward_kwargs.max_resp_len=64"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward_model.reward_manager=batch"], "'batch' is not implemented.*one sample per call"),
        (["reward_model.reward_manager=prime"], "'prime' is not implemented.*use 'naive'"),
        (RECIPE[1:], "is the dapo reward manager's: set reward_model.reward_manager=dapo"),
        ([*RECIPE, "reward_model.overlong_buffer.len=0"], "len must be positive"),
        ([*RECIPE, *MAIN_TRAINER[1:], "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64"], "disagree"),
    ],
)
def test_settings_verl_would_not_run_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
