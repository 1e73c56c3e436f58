"""A step's batch when the user's reward raises on some samples, on a real Redis with the errors a real
``RewardScorer`` gives: by default every prompt group stays whole and the failures are counted; with
``drop`` the old thinning; past the threshold, or when every reward fails, the step stops naming the
user's file and line (not build_batch's "needs at least one trajectory")."""

import functools
import uuid

import pytest

from rlmesh.learner.ppo.batch import validate_trajectory
from rlmesh.learner.run.collect import BatchCollector
from rlmesh.learner.run.feeder import group_uid
from rlmesh.queue import RunKeys, TrajectoryCollector, connect, trajectory_queue
from rlmesh.reward.failures import RewardErrorRule, RewardFailed
from rlmesh.reward.function_loader import load_reward_function
from rlmesh.reward.scorer import RewardScorer
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import reward_pb2, trajectory_pb2

N = 3  # samples per prompt: the last of each raises, a third of them
GROUPS = 4
REWARD = """\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.endswith("2"):
        return {"score": extra_info["missing"]}  # RAISES
    return 1.0
"""
RAISE_LINE = 3


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("r")) as launcher:
        yield launcher.start_redis().url


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_reward.py"
    path.write_text(REWARD)
    return path


async def sampled(reward_file, groups, n=N, always_raise=False):
    """Trajectories of ``groups`` prompts as a replica publishes them: scored by the user's reward,
    a failed score's error copied onto its trajectory."""
    trajs = [
        trajectory_pb2.Trajectory(
            uid=f"{gid}/{k}",
            group_uid=gid,
            prompt_ids=[5, 6],
            response_ids=[7, 8],
            response_text="r2" if always_raise else f"r{k}",
            policy_version=1,
            data_source="mine",
        )
        for gid in groups
        for k in range(n)
    ]
    scorer = RewardScorer(load_reward_function(str(reward_file)), timeout_s=10)
    try:
        results = await scorer.score(
            [
                reward_pb2.RewardSample(
                    uid=t.uid,
                    response_text=t.response_text,
                    ground_truth="1",
                    data_source=t.data_source,
                    extra_info_json="{}",
                )
                for t in trajs
            ]
        )
    finally:
        scorer.close()
    for traj, result in zip(trajs, results, strict=True):  # as rlmesh.rollout.sampler does
        traj.score = result.score
        if result.HasField("error") and result.error.code:
            traj.error.CopyFrom(result.error)
    return trajs


async def collector_with(redis_url, rule):
    redis = connect(redis_url)
    keys = RunKeys(f"rf-{uuid.uuid4().hex[:6]}")
    producer = trajectory_queue(redis, keys, "replica")
    learner = trajectory_queue(redis, keys, "learner-0")
    await learner.ensure_group()
    collector = BatchCollector(
        TrajectoryCollector(learner, keys.used_uids),
        n=N,
        incarnation=3,
        max_staleness=0,
        validate=functools.partial(validate_trajectory, max_prompt_length=4, max_response_length=4),
        rule=rule,
    )
    return redis, producer, learner, collector


async def no_requeue(_t):
    raise AssertionError("nothing should be re-enqueued")


def groups(count=GROUPS):
    """``count`` new group uids of incarnation 3."""
    return [group_uid(3, 1, i) for i in range(count)]


async def test_by_default_every_group_keeps_all_its_samples_and_the_failures_are_counted(
    redis_url, reward_file
):
    redis, producer, learner, collector = await collector_with(redis_url, RewardErrorRule(error_score=-1.0))
    gids = groups()
    await producer.put(await sampled(reward_file, gids))
    batch = await collector.collect(GROUPS, version=1, timeout_s=30, requeue=no_requeue, step=1)

    per_group = {gid: sorted(t.uid for t in batch.trajectories if t.group_uid == gid) for gid in gids}
    assert per_group == {gid: [f"{gid}/{k}" for k in range(N)] for gid in gids}  # not thinned
    scores = {t.uid.rsplit("/", 1)[1]: t.score for t in batch.trajectories}
    assert scores == {"0": 1.0, "1": 1.0, "2": -1.0}
    assert not any(t.HasField("error") for t in batch.trajectories)
    assert (batch.rewards.failed, batch.rewards.samples) == (GROUPS, GROUPS * N)
    assert batch.rewards.metrics("reward") == {
        "reward/failed": 4.0,
        "reward/failed_ratio": pytest.approx(1 / 3),
    }
    assert f"KeyError: 'missing', at {reward_file}:{RAISE_LINE}" in batch.rewards.first
    assert batch.counts["invalid"] == 0 and await learner.dead_letters() == []
    await collector.commit(batch)
    assert await learner.length() == 0 and await learner.pending() == 0
    await redis.aclose()


async def test_drop_leaves_the_failed_samples_out_as_before_and_counts_them(redis_url, reward_file):
    redis, producer, learner, collector = await collector_with(redis_url, RewardErrorRule(on_error="drop"))
    gids = groups()
    await producer.put(await sampled(reward_file, gids))
    batch = await collector.collect(GROUPS, version=1, timeout_s=30, requeue=no_requeue, step=1)

    assert sorted(t.uid.rsplit("/", 1)[1] for t in batch.trajectories) == ["0"] * GROUPS + ["1"] * GROUPS
    assert set(batch.groups) == set(gids)
    assert batch.counts["invalid"] == GROUPS and batch.rewards.failed == GROUPS
    dead = await learner.dead_letters()
    assert len(dead) == GROUPS
    assert all(d.message.HasField("error") for d in dead)  # the trajectory as it came, error and all
    assert all(f"at {reward_file}:{RAISE_LINE}" in d.reason for d in dead)
    await redis.aclose()


async def test_past_the_threshold_the_step_stops_quoting_the_users_file_and_line(redis_url, reward_file):
    redis, producer, _learner, collector = await collector_with(
        redis_url, RewardErrorRule(max_failed_ratio=0.25)
    )
    await producer.put(await sampled(reward_file, groups()))
    with pytest.raises(RewardFailed) as e:
        await collector.collect(GROUPS, version=1, timeout_s=30, requeue=no_requeue, step=7)
    message = str(e.value)
    assert message.startswith(
        "step 7: the reward failed on 4 of 12 samples (33%), more than rlmesh.reward.max_failed_ratio=0.25"
    )
    assert f"KeyError: 'missing', at {reward_file}:{RAISE_LINE}" in message
    assert f'File "{reward_file}", line {RAISE_LINE}, in compute_score' in message
    assert 'return {"score": extra_info["missing"]}  # RAISES' in message
    await redis.aclose()


@pytest.mark.parametrize("rule", [RewardErrorRule(), RewardErrorRule(on_error="drop", max_failed_ratio=1.0)])
async def test_a_reward_that_always_raises_stops_step_1_with_its_file_and_line(redis_url, reward_file, rule):
    redis, producer, _learner, collector = await collector_with(redis_url, rule)
    await producer.put(await sampled(reward_file, groups(), always_raise=True))
    with pytest.raises(RewardFailed) as e:
        await collector.collect(GROUPS, version=1, timeout_s=30, requeue=no_requeue, step=1)
    message = str(e.value)
    assert message.startswith("step 1: the reward failed on 12 of 12 samples (100%), every one of them")
    assert f"at {reward_file}:{RAISE_LINE}" in message and "build_batch" not in message
    await redis.aclose()


async def test_a_failure_that_is_not_the_rewards_is_still_refused(redis_url, reward_file):
    # The reference's (or a replica's) error on a sample: no reward scored it wrong, the rule does not
    # apply, the learner's checks refuse it as before.
    redis, producer, _learner, collector = await collector_with(redis_url, RewardErrorRule())
    trajs = await sampled(reward_file, groups(1))
    trajs[0].error.source, trajs[0].error.message, trajs[0].error.code = "reference", "reference down", 6
    await producer.put(trajs)
    batch = await collector.collect(1, version=1, timeout_s=30, requeue=no_requeue, step=1)
    assert sorted(t.uid for t in batch.trajectories) == [trajs[1].uid, trajs[2].uid]  # 2: penalised
    assert batch.counts["invalid"] == 1
    assert (batch.rewards.failed, batch.rewards.samples) == (1, 3)  # the last one's reward raised
    await redis.aclose()
