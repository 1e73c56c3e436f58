"""A step never waits forever for groups that cannot arrive (real Redis, the real queues)."""

import logging
import uuid

import pytest

from rlmesh.learner.run.recovery import LostGroupRecovery
from rlmesh.queue import RunKeys, connect, prompt_queue, trajectory_queue
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import trajectory_pb2
from tests.support.data import prompt_items
from tests.support.learner import feeder_and_collector

N = 2


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("r")) as launcher:
        yield launcher.start_redis().url


@pytest.fixture
async def run(redis_url):
    redis = connect(redis_url)
    keys = RunKeys(f"rec-{uuid.uuid4().hex[:6]}")
    items = prompt_items(20)
    feeder, collector = await feeder_and_collector(redis, keys, items, batch_size=4, n=N)
    replica = Replica(prompt_queue(redis, keys, "replica"), trajectory_queue(redis, keys, "replica"))
    yield feeder, collector, LostGroupRecovery(feeder, collector), replica
    await redis.aclose()


class Replica:
    """What a rollout replica does with a task, driven by the test: publish its samples, then ack."""

    def __init__(self, prompts, trajectories):
        self.prompts, self.trajectories = prompts, trajectories

    async def claim(self, count=100):
        return await self.prompts.claim(count)

    async def finish(self, delivery):
        t = delivery.message
        await self.trajectories.put(
            [
                trajectory_pb2.Trajectory(
                    uid=f"{t.group_uid}/{i}", group_uid=t.group_uid, prompt_ids=t.prompt_ids, response_ids=[1]
                )
                for i in range(t.n)
            ]
        )
        await self.prompts.ack([delivery.entry_id])

    async def refuse(self, delivery, reason):
        await self.prompts.dead_letter(delivery.entry_id, delivery.message.SerializeToString(), reason, 1)


async def nothing(_t):
    raise AssertionError("no stale groups here")


async def short_of(collector, groups):
    """The learner's wait for its batch, which runs out before the recovery checks."""
    with pytest.raises(TimeoutError):
        await collector.collect(groups, 0, timeout_s=0.3, requeue=nothing)


async def test_lost_tasks_are_enqueued_again_once_nothing_is_in_flight(run, caplog):
    feeder, collector, recovery, replica = run
    await feeder.ensure(1, version=0, max_staleness=0)
    deliveries = await replica.claim()
    lost = [d.message.group_uid for d in deliveries[:2]]
    # Redis loses two tasks (say, its last second of writes in a crash) while a replica works on one.
    await feeder.queue.redis.xdel(feeder.queue.stream, *[d.entry_id for d in deliveries[:2]])
    assert await recovery.check(0) == [] and await recovery.check(0) == []  # a task is still in flight
    for d in deliveries[2:]:
        await replica.finish(d)
    await short_of(collector, 4)
    assert await recovery.check(0) == []  # quiet once is not enough
    with caplog.at_level(logging.WARNING, "rlmesh.learner"):
        again = await recovery.check(0)
    assert len(again) == 2 and not set(again) & set(lost)
    assert all(gid in caplog.text for gid in lost) and "gone from Redis" in caplog.text
    assert recovery.take_counts() == {"requeued_lost": 2, "replaced_failed": 0}
    retried = await replica.claim()
    assert sorted(d.message.prompt_ids[0] for d in retried) == sorted(
        d.message.prompt_ids[0] for d in deliveries[:2]
    )  # the same prompts, under new group uids
    for d in retried:
        await replica.finish(d)
    batch = await collector.collect(4, 0, timeout_s=30, requeue=nothing)
    assert len(batch.groups) == 4 and len(batch.trajectories) == 4 * N
    feeder.taken(batch.groups)
    assert feeder.outstanding == {}


async def test_samples_of_a_group_given_up_on_that_arrive_late_are_discarded_and_acked(run):
    feeder, collector, recovery, replica = run
    await feeder.ensure(1, version=0, max_staleness=0)
    deliveries = await replica.claim()
    late = deliveries[0]
    # Its task vanishes from Redis while the replica still works on it, slowly.
    await feeder.queue.redis.xdel(feeder.queue.stream, late.entry_id)
    for d in deliveries[1:]:
        await replica.finish(d)
    await short_of(collector, 4)
    assert await recovery.check(0) == []
    (again,) = await recovery.check(0)
    await replica.finish(late)  # the old group's samples arrive after all
    (retry,) = await replica.claim()
    assert retry.message.group_uid == again
    await replica.finish(retry)
    batch = await collector.collect(4, 0, timeout_s=30, requeue=nothing)
    assert late.message.group_uid not in batch.groups and again in batch.groups
    assert len(batch.trajectories) == 4 * N and batch.counts["abandoned_group"] == N
    await collector.commit(batch)
    assert await collector.collector.queue.length() == 0  # the latecomers are acked with the step


async def test_a_prompt_that_keeps_failing_is_replaced_by_the_next_one(run, caplog):
    feeder, collector, recovery, replica = run
    await feeder.ensure(1, version=0, max_staleness=0)
    first = await replica.claim()
    await replica.refuse(first[0], "rejected: sampling_params.top_p=5.0: must be in (0, 1]")
    for d in first[1:]:
        await replica.finish(d)
    await short_of(collector, 4)
    with caplog.at_level(logging.WARNING, "rlmesh.learner"):
        assert await recovery.check(0) == []
        (again,) = await recovery.check(0)
    assert "top_p=5.0" in caplog.text  # the dead letter's reason is in the log
    (retry,) = await replica.claim()
    assert retry.message.group_uid == again and retry.message.prompt_ids == first[0].message.prompt_ids
    await replica.refuse(retry, "rejected: still bad")
    assert await recovery.check(0) == []
    with caplog.at_level(logging.ERROR, "rlmesh.learner"):
        (replacement,) = await recovery.check(0)
    assert "failed 2 times" in caplog.text and "still bad" in caplog.text
    (fresh,) = await replica.claim()
    assert fresh.message.group_uid == replacement
    assert fresh.message.prompt_ids == [5]  # the next prompt of the data (no shuffling: index 4)
    await replica.finish(fresh)
    batch = await collector.collect(4, 0, timeout_s=30, requeue=nothing)
    assert len(batch.groups) == 4
    assert recovery.take_counts() == {"requeued_lost": 1, "replaced_failed": 1}


async def test_groups_that_are_still_on_their_way_are_left_alone(run):
    feeder, collector, recovery, replica = run
    await feeder.ensure(1, version=0, max_staleness=0)
    deliveries = await replica.claim()
    for d in deliveries:
        await replica.finish(d)
    # Published but not read by the learner yet: unread trajectories mean nothing is lost.
    for _ in range(3):
        assert await recovery.check(0) == []
    batch = await collector.collect(4, 0, timeout_s=30, requeue=nothing)
    assert len(batch.groups) == 4
    feeder.taken(batch.groups)  # as the learner does once it has its batch
    for _ in range(3):  # collected: nothing outstanding is missing either
        assert await recovery.check(0) == []
