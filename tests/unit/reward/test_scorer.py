"""RewardScorer without gRPC: per-sample errors, timeouts, the concurrency limit, validation,
metrics, and loading user functions."""

import asyncio
import json
import math
import sys
import textwrap
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from rlmesh.reward.function_loader import (
    RewardFunction,
    RewardFunctionLoadError,
    builtin_function,
    load_reward_function,
)
from rlmesh.reward.scorer import RewardScorer
from rlmesh.runtime.invalid_request import InvalidRequestError
from rlmesh.v1 import common_pb2, reward_pb2

Code = common_pb2.ErrorCode


def sample(uid="u", response="", truth="", source="test", extra=None, **kw):
    # response=None leaves response_text unset (the service decodes response_ids).
    text = {} if response is None else {"response_text": response}
    return reward_pb2.RewardSample(
        uid=uid,
        **text,
        ground_truth=truth,
        data_source=source,
        extra_info_json=json.dumps(extra) if extra is not None else "",
        **kw,
    )


def misbehaving(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise ValueError("boom")
    if solution_str == "exit":
        raise SystemExit(3)
    if solution_str == "nan":
        return math.nan
    if solution_str == "inf":
        return -math.inf
    if solution_str == "str":
        return "high"
    if solution_str == "none":
        return None
    if solution_str == "nodict":
        return {"acc": 1.0}
    if solution_str == "numpy":
        return np.float32(0.25)
    if solution_str == "sleep":
        time.sleep(1.0)
        return 1.0
    return {"score": float(solution_str == ground_truth), "acc": 1.0, "pred": "text extras are dropped"}


def fn(f, name="test:fn", **kwargs):
    return RewardFunction(name=name, fn=f, is_async=asyncio.iscoroutinefunction(f), kwargs=kwargs)


def counter(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


async def test_per_sample_failures_become_errors_and_the_rest_of_the_batch_is_scored():
    registry = CollectorRegistry()
    scorer = RewardScorer(fn(misbehaving), registry=registry, timeout_s=0.3)
    batch = [
        sample("ok", "42", "42"),
        sample("raise", "raise"),
        sample("exit", "exit"),
        sample("nan", "nan"),
        sample("inf", "inf"),
        sample("str", "str"),
        sample("none", "none"),
        sample("nodict", "nodict"),
        sample("numpy", "numpy"),
        sample("sleep", "sleep"),
        sample("wrong", "41", "42"),
    ]
    results = {r.uid: r for r in await scorer.score(batch)}
    assert [r.uid for r in await scorer.score(batch[:2])] == ["ok", "raise"]  # order kept
    ok = results["ok"]
    assert not ok.HasField("error") and ok.score == 1.0 and dict(ok.extra) == {"acc": 1.0}
    assert results["wrong"].score == 0.0 and not results["wrong"].HasField("error")
    assert results["numpy"].score == 0.25
    expected = {
        "raise": (Code.ERROR_CODE_FUNCTION_FAILED, "ValueError: boom"),
        "exit": (Code.ERROR_CODE_FUNCTION_FAILED, "SystemExit: 3"),
        "nan": (Code.ERROR_CODE_NON_FINITE, "nan"),
        "inf": (Code.ERROR_CODE_NON_FINITE, "-inf"),
        "str": (Code.ERROR_CODE_NOT_A_NUMBER, "str 'high'"),
        "none": (Code.ERROR_CODE_NOT_A_NUMBER, "NoneType"),
        "nodict": (Code.ERROR_CODE_NOT_A_NUMBER, "without a 'score' key"),
        "sleep": (Code.ERROR_CODE_TIMEOUT, "did not finish within 0.3 s"),
    }
    for uid, (code, text) in expected.items():
        err = results[uid].error
        assert err.code == code, (uid, err)
        assert text in err.message and f"uid='{uid}'" in err.message and "data_source='test'" in err.message
        assert err.source == "reward:test:fn"
    assert (
        counter(registry, "rlmesh_reward_sample_errors_total", reason="non_finite", function="test:fn") == 2
    )
    assert counter(registry, "rlmesh_reward_sample_errors_total", reason="timeout", function="test:fn") == 1
    assert counter(registry, "rlmesh_reward_samples_total", function="test:fn") == len(batch) + 2
    assert counter(registry, "rlmesh_reward_score_count", function="test:fn") == 4
    # the scorer still works after all that
    assert (await scorer.score([sample("again", "7", "7")]))[0].score == 1.0
    scorer.close()


async def test_async_functions_are_awaited_with_the_timeout():
    async def slow_or_not(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "slow":
            await asyncio.sleep(5)
        if solution_str == "raise":
            raise RuntimeError("async boom")
        return len(solution_str)

    scorer = RewardScorer(fn(slow_or_not), timeout_s=0.2)
    t0 = time.monotonic()
    fast, slow, bad = await scorer.score([sample("a", "abc"), sample("b", "slow"), sample("c", "raise")])
    assert time.monotonic() - t0 < 2
    assert fast.score == 3.0
    assert slow.error.code == Code.ERROR_CODE_TIMEOUT
    assert (
        bad.error.code == Code.ERROR_CODE_FUNCTION_FAILED and "RuntimeError: async boom" in bad.error.message
    )
    scorer.close()


async def test_the_call_deadline_bounds_every_sample():
    def sleepy(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(0.5)
        return 1.0

    scorer = RewardScorer(fn(sleepy), timeout_s=30)
    t0 = time.monotonic()
    (result,) = await scorer.score([sample()], timeout_s=0.1)
    assert time.monotonic() - t0 < 0.4 and result.error.code == Code.ERROR_CODE_TIMEOUT
    scorer.close()


async def test_concurrency_limit_makes_extra_calls_wait():
    running = 0
    peak = 0
    release = asyncio.Event()

    async def tracked(data_source, solution_str, ground_truth, extra_info=None):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1
        return 1.0

    registry = CollectorRegistry()
    scorer = RewardScorer(fn(tracked), max_concurrency=2, registry=registry)
    calls = [asyncio.create_task(scorer.score([sample(f"{i}-{j}") for j in range(3)])) for i in range(5)]
    for _ in range(200):
        await asyncio.sleep(0.005)
        if running == 6:
            break
    assert running == 6  # two calls of three samples each
    assert registry.get_sample_value("rlmesh_reward_calls_waiting") == 3
    release.set()
    results = await asyncio.gather(*calls)
    assert peak == 6 and registry.get_sample_value("rlmesh_reward_calls_waiting") == 0
    assert all(r.score == 1.0 for call in results for r in call)
    scorer.close()


async def test_builtins_by_data_source_and_unknown_sources():
    scorer = RewardScorer()
    gsm, arith, unknown = await scorer.score(
        [
            sample("g", "#### 1,234", "1234", "openai/gsm8k"),
            sample("a", "#### 33", "33", "arithmetic"),
            sample("x", "#### 1", "1", "somewhere/else"),
        ]
    )
    assert gsm.score == 1.0 and arith.score == 1.0 and dict(arith.extra) == {"acc": 1.0, "format": 1.0}
    assert unknown.error.code == Code.ERROR_CODE_INVALID_INPUT
    assert "no reward function" in unknown.error.message and "openai/gsm8k=gsm8k" in unknown.error.message
    assert "openai/gsm8k=gsm8k" in scorer.info().functions and "aime*=math_dapo" in scorer.info().functions
    forced = RewardScorer(builtin_function("gsm8k"))
    assert (await forced.score([sample("f", "#### 5", "5", "anything")]))[0].score == 1.0
    assert list(forced.info().functions) == ["*=gsm8k"]
    with pytest.raises(RewardFunctionLoadError, match="unknown built-in"):
        builtin_function("gsm9k")


async def test_extra_info_reaches_the_function_and_bad_json_is_a_sample_error():
    seen = []

    def record(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return 0.0

    scorer = RewardScorer(fn(record))
    good, bad, empty = await scorer.score(
        [
            sample("a", extra={"index": 3}),
            reward_pb2.RewardSample(uid="b", extra_info_json="{nope"),
            sample("c"),
        ]
    )
    assert seen == [{"index": 3}, {}]
    assert bad.error.code == Code.ERROR_CODE_INVALID_INPUT and "not valid JSON" in bad.error.message
    assert not good.HasField("error") and not empty.HasField("error")


async def test_response_ids_are_decoded_when_the_text_is_missing():
    from rlmesh.models import build_tokenizer

    tok = build_tokenizer()
    scorer = RewardScorer(builtin_function("gsm8k"), tokenizer=tok)
    ids = tok("#### 72<|endoftext|>")["input_ids"]
    (result,) = await scorer.score([sample("a", response=None, truth="72", response_ids=ids)])
    assert result.score == 1.0
    no_tok = RewardScorer(builtin_function("gsm8k"))
    (result,) = await no_tok.score([sample("a", response=None, truth="72", response_ids=ids)])
    assert result.error.code == Code.ERROR_CODE_INVALID_INPUT and "no tokenizer" in result.error.message


async def test_an_empty_response_text_is_the_text_not_a_missing_one():
    # A response of special tokens only decodes to "": scored as "", with or without a tokenizer.
    seen = []

    def record(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return 0.5

    (result,) = await RewardScorer(fn(record)).score([sample("a", response="", response_ids=[7, 7])])
    assert not result.HasField("error") and result.score == 0.5 and seen == [""]


def test_malformed_batches_are_refused_naming_the_problem():
    scorer = RewardScorer(max_batch_size=4, vocab_size=100)
    with pytest.raises(InvalidRequestError, match="empty batch"):
        scorer.validate([])
    with pytest.raises(
        InvalidRequestError, match="batch of 5 samples is over this service's max_batch_size of 4"
    ):
        scorer.validate([sample(str(i)) for i in range(5)])
    with pytest.raises(InvalidRequestError, match=r"sample 1 \(uid 'b'\): response_ids holds token id 100"):
        scorer.validate([sample("a", response_ids=[1, 2]), sample("b", response_ids=[5, 100])])
    with pytest.raises(
        InvalidRequestError, match=r"sample 0 \(uid 'a'\): prompt_ids holds a negative token id -1"
    ):
        scorer.validate([sample("a", prompt_ids=[3, -1])])
    scorer.validate([sample("a", prompt_ids=[0, 99], response_ids=[99])])


def test_loading_by_dotted_path_file_path_and_pkg(tmp_path, monkeypatch):
    module = tmp_path / "my_rewards_mod.py"
    module.write_text(
        textwrap.dedent(
            """
            def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
                return float(solution_str == ground_truth) + bonus

            async def async_score(data_source, solution_str, ground_truth, extra_info=None):
                return 1.0

            def two_args(solution, truth):
                return 0.0

            def by_kwargs(**kwargs):
                return 0.0

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    by_dotted = load_reward_function("my_rewards_mod:compute_score")
    assert by_dotted.name == "my_rewards_mod:compute_score" and not by_dotted.is_async
    assert by_dotted.call("s", "1", "1", None) == 1.0
    assert load_reward_function("my_rewards_mod", "async_score").is_async
    assert load_reward_function("pkg://my_rewards_mod", "by_kwargs").name == "my_rewards_mod:by_kwargs"
    by_file = load_reward_function(str(module), "compute_score", {"bonus": 0.5})
    assert by_file.call("s", "1", "1", None) == 1.5
    errors = {
        "nope_missing_pkg.sub:fn": "cannot import module 'nope_missing_pkg.sub'",
        "my_rewards_mod:missing": "has no attribute 'missing'; its callables: async_score, by_kwargs, compute_score",
        "my_rewards_mod:two_args": "signature (solution, truth) does not fit",
        "my_rewards_mod:NOT_CALLABLE": "is a int, not a function",
        str(tmp_path / "absent.py"): "no such file",
        "my_rewards_mod:": "expected 'package.module:function'",
    }
    for path, message in errors.items():
        with pytest.raises(RewardFunctionLoadError, match=r"custom_reward_function\.path=") as err:
            load_reward_function(path)
        assert message in str(err.value), (path, str(err.value))
    with pytest.raises(RewardFunctionLoadError, match=r"plus reward_kwargs \['weight'\]"):
        load_reward_function("my_rewards_mod:compute_score", reward_kwargs={"weight": 2})
    sys.modules.pop("my_rewards_mod", None)


def test_from_config_picks_the_function(tmp_path, monkeypatch):
    from rlmesh.config import load_config

    (tmp_path / "cfg_reward_mod.py").write_text(
        "def score_it(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(
        None, ["custom_reward_function.path=cfg_reward_mod", "custom_reward_function.name=score_it"]
    )
    scorer = RewardScorer.from_config(cfg, load_tokenizer=False)
    assert scorer.function.name == "cfg_reward_mod:score_it"
    with pytest.raises(RewardFunctionLoadError, match="both set"):
        RewardScorer.from_config(cfg, forced="gsm8k", load_tokenizer=False)
    assert RewardScorer.from_config(load_config(None, []), load_tokenizer=False).function is None
    sys.modules.pop("cfg_reward_mod", None)


def test_from_config_reads_the_rlmesh_reward_keys():
    from rlmesh.config import load_config

    keys = ["function=arithmetic", "function_timeout_s=2.5", "max_batch_size=8", "workers=3", "timeout_s=9"]
    scorer = RewardScorer.from_config(
        load_config(None, [f"rlmesh.reward.{k}" for k in keys]), load_tokenizer=False
    )
    assert scorer.function.name == "arithmetic" and scorer.timeout_s == 2.5 and scorer.max_batch_size == 8
    assert scorer._pool.workers == 3
    plain = RewardScorer.from_config(load_config(None, ["rlmesh.reward.timeout_s=9"]), load_tokenizer=False)
    assert plain.timeout_s == 9 and plain.max_batch_size == 1024 and plain._pool.workers == 32
