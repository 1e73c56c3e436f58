"""The reward service as a real process on loopback: user functions by dotted path, per-sample
errors, malformed requests, start-up failures, auth, and replicas swapped through Redis."""

import asyncio
import os
import textwrap
import time
import uuid
from pathlib import Path

import grpc
import pytest

from rlmesh.config import load_config
from rlmesh.job.report import metric_sum
from rlmesh.models import build_tokenizer
from rlmesh.queue import connect
from rlmesh.reward.addresses import get_reward_addresses, set_reward_addresses
from rlmesh.reward.client import RewardClient
from rlmesh.runtime.balancer import ServiceCallError
from rlmesh.runtime.health import scrape_metrics
from rlmesh.runtime.launcher import LaunchError
from rlmesh.runtime.net import free_port
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

TOKEN = "s3cret-token"
FUNCTION = "rlmesh_test_rewards:compute_score"
USER_MODULE = '''
import math
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Misbehaves on request, else 1.0 for an exact match, with extras."""
    if solution_str == "raise":
        raise ZeroDivisionError("user code divided by zero")
    if solution_str == "nan":
        return math.nan
    if solution_str == "str":
        return "very good"
    if solution_str == "sleep":
        time.sleep(3)
    correct = float(solution_str.strip() == ground_truth)
    return {"score": correct, "acc": correct, "index": float((extra_info or {}).get("index", -1))}


def two_args(solution, truth):
    return 0.0
'''


def port_overrides():
    return ["rlmesh.reward.port=0", "rlmesh.reward.metrics_port=0"]


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    src = tmp_path_factory.mktemp("user-code")
    (src / "rlmesh_test_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.fixture(scope="module")
def custom(launcher, user_env, tmp_path_factory):
    tokenizer_dir = tmp_path_factory.mktemp("tok")
    build_tokenizer(tokenizer_dir)
    return launcher.start_service(
        "reward",
        name="reward-custom",
        overrides=[
            *port_overrides(),
            f"custom_reward_function.path={FUNCTION}",
            f"actor_rollout_ref.model.path={tokenizer_dir}",  # the policy tokenizer: decodes ids, checks them
            f"rlmesh.auth_token={TOKEN}",
            "rlmesh.reward.function_timeout_s=1",
            "rlmesh.reward.max_batch_size=8",
        ],
        env=user_env,
    )


def sample(uid, response, truth="42", **kw):
    # response=None leaves response_text unset: the service decodes response_ids.
    text = {} if response is None else {"response_text": response}
    return reward_pb2.RewardSample(uid=uid, **text, ground_truth=truth, data_source="mine", **kw)


async def test_a_user_function_by_dotted_path_scores_and_its_failures_stay_per_sample(custom):
    async with RewardClient([custom.grpc_address], token=TOKEN, timeout_s=30) as client:
        info = await client.info()
        assert list(info.functions) == [f"*={FUNCTION}"] and info.max_batch_size == 8
        results = await client.score(
            [
                sample("good", "42", extra_info_json='{"index": 7}'),
                sample("raise", "raise"),
                sample("nan", "nan"),
                sample("str", "str"),
                sample("wrong", "41"),
                sample("ids", None, response_ids=[21, 19]),  # "42" in the char tokenizer
            ]
        )
        by_uid = {r.uid: r for r in results}
        assert [r.uid for r in results] == ["good", "raise", "nan", "str", "wrong", "ids"]
        assert by_uid["good"].score == 1.0 and dict(by_uid["good"].extra) == {"acc": 1.0, "index": 7.0}
        assert by_uid["wrong"].score == 0.0 and not by_uid["wrong"].HasField("error")
        assert by_uid["ids"].score == 1.0
        err = by_uid["raise"].error
        assert err.code == common_pb2.ERROR_CODE_FUNCTION_FAILED and err.source == f"reward:{FUNCTION}"
        assert "uid='raise'" in err.message and "data_source='mine'" in err.message
        assert "ZeroDivisionError: user code divided by zero" in err.message
        assert by_uid["nan"].error.code == common_pb2.ERROR_CODE_NON_FINITE
        assert by_uid["str"].error.code == common_pb2.ERROR_CODE_NOT_A_NUMBER
        # the next call works, the raising one included
        again = await client.score([sample("raise", "raise"), sample("fine", "42")])
        assert again[0].error.code == common_pb2.ERROR_CODE_FUNCTION_FAILED and again[1].score == 1.0

        t0 = time.monotonic()
        slow, fast = await client.score([sample("slow", "sleep"), sample("fast", "42")])
        assert time.monotonic() - t0 < 2.5
        assert slow.error.code == common_pb2.ERROR_CODE_TIMEOUT and "within 1 s" in slow.error.message
        assert fast.score == 1.0

    host = custom.grpc_address.rsplit(":", 1)[0]
    metrics = scrape_metrics(host, custom.metrics_port)
    labels = f'function="{FUNCTION}",reason="function_failed"'
    assert f"rlmesh_reward_sample_errors_total{{{labels}}} 2.0" in metrics
    assert f'rlmesh_reward_sample_errors_total{{function="{FUNCTION}",reason="timeout"}} 1.0' in metrics
    assert f'rlmesh_reward_samples_total{{function="{FUNCTION}"}} 10.0' in metrics
    assert "rlmesh_reward_score_bucket" in metrics
    # Calls and samples per call: three Score calls of 6, 2 and 2 samples.
    assert metric_sum(metrics, "rlmesh_rpc_requests_total", method="/rlmesh.v1.Reward/Score") == 3
    assert metric_sum(metrics, "rlmesh_reward_batch_size_count") == 3
    assert metric_sum(metrics, "rlmesh_reward_batch_size_sum") == 10


async def test_a_failure_names_the_users_file_and_line_across_the_wire(custom, user_env):
    # What the learner quotes when it stops a run: the user's file, line and code, not the service's.
    source = Path(user_env["PYTHONPATH"].split(os.pathsep)[0]) / "rlmesh_test_rewards.py"
    lines = textwrap.dedent(USER_MODULE).splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "raise ZeroDivisionError" in text)
    async with RewardClient([custom.grpc_address], token=TOKEN, timeout_s=30) as client:
        (result,) = await client.score([sample("raise", "raise")])
    headline, *frames = result.error.message.splitlines()
    assert headline.endswith(f"raised ZeroDivisionError: user code divided by zero, at {source}:{line}")
    assert frames == [
        f'  File "{source}", line {line}, in compute_score',
        '    raise ZeroDivisionError("user code divided by zero")',
    ]


async def test_malformed_requests_get_invalid_argument_naming_the_problem(custom):
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    cases = {
        "empty batch": [],
        "batch of 9 samples is over this service's max_batch_size of 8": [
            sample(str(i), "1") for i in range(9)
        ],
        "sample 1 (uid 'b'): response_ids holds token id 100, not below the vocabulary size 100": [
            sample("a", "1"),
            sample("b", "", response_ids=[5, 100]),
        ],
        "sample 0 (uid 'neg'): prompt_ids holds a negative token id -2": [
            sample("neg", "1", prompt_ids=[-2])
        ],
    }
    async with grpc.aio.insecure_channel(custom.grpc_address) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        for message, samples in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Score(reward_pb2.ScoreRequest(samples=samples), timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details(), err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Score(reward_pb2.ScoreRequest(samples=[sample("a", "1")]), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with RewardClient([custom.grpc_address], token=TOKEN) as client:
        with pytest.raises(ServiceCallError) as err:  # not retried: the request itself is wrong
            await client.score([])
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.tried == [custom.grpc_address]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_pkg.scoring:compute_score", "cannot import module 'no_such_pkg.scoring'"),
        ("rlmesh_test_rewards:missing", "has no attribute 'missing'"),
        ("rlmesh_test_rewards:two_args", "signature (solution, truth) does not fit"),
    ],
)
def test_a_reward_function_that_does_not_load_stops_the_service_saying_which(
    launcher, user_env, path, message
):
    with pytest.raises(LaunchError) as err:
        launcher.start_service(
            "reward",
            name=f"reward-bad-{path.split(':')[-1]}",
            overrides=[*port_overrides(), f"custom_reward_function.path={path}"],
            env=user_env,
            timeout_s=60,
        )
    text = str(err.value)
    assert (
        "exited with code 2" in text and message in text and f"custom_reward_function.path='{path}'" in text
    )


async def test_replicas_round_robin_and_swap_through_redis_without_restart(launcher):
    redis_server = launcher.start_redis(name="reward-redis")
    run_id = f"swap-{uuid.uuid4().hex[:6]}"
    a = launcher.start_service(
        "reward", name="reward-a", overrides=[*port_overrides(), "rlmesh.reward.function=gsm8k"]
    )
    b = launcher.start_service(
        "reward", name="reward-b", overrides=[*port_overrides(), "rlmesh.reward.function=arithmetic"]
    )
    cfg = load_config(
        None,
        [
            f"rlmesh.run_id={run_id}",
            f"rlmesh.redis_url={redis_server.url}",
            f"rlmesh.reward.addresses={a.grpc_address}",
        ],
    )
    redis = connect(redis_server.url)
    names = {a.grpc_address: "*=gsm8k", b.grpc_address: "*=arithmetic"}

    async def served_by(client, calls):
        return {(await client.info()).functions[0] for _ in range(calls)}

    async def wait_for(client, expected):
        deadline = time.monotonic() + 5
        while (seen := await served_by(client, 2)) != expected:
            assert time.monotonic() < deadline, f"still served by {seen}, expected {expected}"
            await asyncio.sleep(0.1)

    try:
        async with RewardClient.from_config(cfg, redis=redis, timeout_s=10) as client:
            assert await served_by(client, 3) == {"*=gsm8k"}  # nothing in Redis: the configured address
            assert await get_reward_addresses(redis, run_id) is None
            await set_reward_addresses(redis, run_id, [b.grpc_address])
            t0 = time.monotonic()
            await wait_for(client, {"*=arithmetic"})
            assert time.monotonic() - t0 < 2.0  # clients re-read the list at least every 0.5 s
            result = await client.score(
                [reward_pb2.RewardSample(uid="x", response_text="#### 5", ground_truth="5")]
            )
            assert result[0].score == 1.0 and "format" in result[0].extra  # the arithmetic scorer answered
            await set_reward_addresses(redis, run_id, [a.grpc_address, b.grpc_address])
            await wait_for(client, set(names.values()))  # round-robin: both replicas answer
            dead = f"127.0.0.1:{free_port()}"
            await set_reward_addresses(redis, run_id, [dead, a.grpc_address])
            await asyncio.sleep(0.6)
            for _ in range(4):  # every other call first tries the dead address, then retries on the next
                assert (await client.info()).functions[0] == "*=gsm8k"
            with pytest.raises(ValueError, match="not a host:port"):
                await set_reward_addresses(redis, run_id, ["nonsense"])
    finally:
        await redis.aclose()
