"""DAPO's dynamic sampling against a real Redis: the collector drops groups whose samples all score
alike, the feeder draws the next prompts of the data in their place, and the dropped groups are
consumed with the step (acked, their uids marked used), never trained on nor lost."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from rlmesh.learner.run.dynamic_sampling import DynamicSamplingError, GenBatches, GroupFilter, draw_in_place
from rlmesh.learner.run.feeder import index_of
from rlmesh.queue import RunKeys, connect, prompt_queue, trajectory_queue
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import trajectory_pb2
from tests.support.data import prompt_items
from tests.support.learner import feeder_and_collector

N, BATCH = 2, 4


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("r")) as launcher:
        yield launcher.start_redis().url


def acc_of(index: int, sample: int) -> float:
    """The test's reward: every sample of an even prompt is wrong (a uniform group), an odd prompt's
    first sample is right and its second wrong."""
    return 0.0 if index % 2 == 0 else float(sample == 0)


class Replica:
    """Answers every prompt task until stopped: N samples with ``acc_of``'s accuracy as their score."""

    def __init__(self, prompts, trajectories):
        self.prompts, self.trajectories = prompts, trajectories
        self.stop = asyncio.Event()

    async def serve(self) -> None:
        # Stopped between claims, never cancelled inside a Redis command.
        while not self.stop.is_set():
            for delivery in await self.prompts.claim(100, block_ms=100):
                task = delivery.message
                index = task.prompt_ids[0] - 1  # prompt_items: index i holds token i + 1
                samples = []
                for i in range(task.n):
                    t = trajectory_pb2.Trajectory(
                        uid=f"{task.group_uid}/{i}",
                        group_uid=task.group_uid,
                        prompt_ids=task.prompt_ids,
                        response_ids=[1],
                        score=acc_of(index, i),
                    )
                    t.reward_extra["acc"] = acc_of(index, i)
                    samples.append(t)
                await self.trajectories.put(samples)
                await self.prompts.ack([delivery.entry_id])


@pytest.fixture
async def run(redis_url):
    redis = connect(redis_url)
    keys = RunKeys(f"ds-{uuid.uuid4().hex[:6]}")
    items = prompt_items(40)
    feeder, collector = await feeder_and_collector(
        redis, keys, items, batch_size=BATCH, n=N, keep_group=GroupFilter("acc")
    )
    replica = Replica(prompt_queue(redis, keys, "replica"), trajectory_queue(redis, keys, "replica"))
    serving = asyncio.create_task(replica.serve())
    yield feeder, collector
    replica.stop.set()
    await serving
    await redis.aclose()


async def nothing(_t):
    raise AssertionError("no stale groups here")


async def collect_step(feeder, collector, gen_batches, step):
    gen_batches.start_step()
    await feeder.ensure(step, version=0, max_staleness=0)

    async def refill(dropped):
        await draw_in_place(feeder, gen_batches, dropped, step, version=0)

    return await collector.collect(BATCH, 0, timeout_s=60, requeue=nothing, refill=refill)


def expected_draws(start: int) -> tuple[list[int], list[int], int]:
    """verl's outcome from the cursor's order: the shortest run of prompts from ``start`` that holds
    BATCH kept ones. (kept prompts, dropped prompts, prompts drawn)."""
    kept, dropped, index = [], [], start
    while len(kept) < BATCH:
        values = [acc_of(index, i) for i in range(N)]
        (kept if len(set(values)) > 1 else dropped).append(index)
        index += 1
    return kept, dropped, index - start


async def test_uniform_groups_are_replaced_by_the_next_prompts_and_consumed_with_the_step(run):
    feeder, collector = run
    gen_batches = GenBatches(BATCH, max_num_gen_batches=0)
    start = 0
    for step in (1, 2):
        batch = await collect_step(feeder, collector, gen_batches, step)
        kept, dropped, drawn = expected_draws(start)
        assert sorted(index_of(g) for g in batch.groups) == kept
        assert sorted(index_of(g) for g in batch.filtered) == dropped
        assert list(batch.filtered.values()) == [N] * len(dropped)
        for gid in batch.groups:  # every trained group has a spread in its metric
            assert len({t.reward_extra["acc"] for t in batch.trajectories if t.group_uid == gid}) > 1
        assert gen_batches.drawn == drawn and gen_batches.num_gen_batches == -(-drawn // BATCH) > 1
        assert feeder.cursor.state_dict()["position"] == start + drawn  # nothing drawn and left over
        # The step consumes the dropped groups: their entries are acked and their uids marked used
        # with the trained ones, so a copy delivered again is refused as a duplicate.
        filtered_uids = [f"{g}/{i}" for g in batch.filtered for i in range(N)]
        assert set(filtered_uids) <= set(batch.uids)
        await collector.commit(batch)
        feeder.taken(batch.groups)
        assert feeder.outstanding == {}  # nothing waited for: no dropped group comes back
        assert await collector.collector.queue.pending() == 0
        assert await collector.collector.queue.length() == 0
        assert all(await collector.collector.used(filtered_uids))
        start += drawn


async def test_the_limit_on_generation_batches_fails_the_step_as_verl_does(run):
    feeder, collector = run
    # Prompts 0..3 hold two uniform groups: one batch of prompts cannot keep four groups.
    with pytest.raises(DynamicSamplingError, match="num_gen_batches=1 >= max_num_gen_batches=1"):
        await collect_step(feeder, collector, GenBatches(BATCH, max_num_gen_batches=1), 1)


async def test_a_refill_that_redis_refuses_once_is_drawn_again_with_the_same_prompt(run, monkeypatch):
    feeder, collector = run
    put = feeder.queue.put
    failures = []

    async def flaky_put(tasks):
        if (
            tasks[0].step == 1
            and not failures
            and len(feeder.outstanding) == BATCH
            and index_of(tasks[0].group_uid) >= BATCH
        ):
            failures.append(index_of(tasks[0].group_uid))
            raise RedisConnectionError("Redis restarting")
        return await put(tasks)

    monkeypatch.setattr(feeder.queue, "put", flaky_put)
    batch = await collect_step(feeder, collector, GenBatches(BATCH, 0), 1)
    kept, _, drawn = expected_draws(0)
    assert failures == [BATCH]  # the first refill failed, and was drawn again: the same prompt
    assert sorted(index_of(g) for g in batch.groups) == kept
    assert feeder.cursor.state_dict()["position"] == drawn
