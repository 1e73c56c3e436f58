"""Batch collection for a learner step against a real Redis."""

import functools
import math
import uuid

import pytest
import torch

from rlmesh.learner.ppo.batch import BatchBuilder, build_batch, validate_trajectory
from rlmesh.learner.run.collect import BatchCollector
from rlmesh.learner.run.feeder import PromptFeeder, group_uid, incarnation_of, index_of, step_of
from rlmesh.queue import RunKeys, TrajectoryCollector, connect, prompt_queue, trajectory_queue
from rlmesh.queue.signing import signer_for
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import trajectory_pb2
from tests.support.data import prompt_items


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("r")) as launcher:
        yield launcher.start_redis().url


def validate(t):
    if t.HasField("error") and t.error.code:
        return f"error: {t.error.message}"
    if not math.isfinite(t.score):
        return f"score {t.score} is not finite"
    return None


def group(gid, n, version=1, score=1.0, tokens=(), prompt=1, response=2):
    return [
        trajectory_pb2.Trajectory(
            uid=f"{gid}/{i}",
            group_uid=gid,
            response_ids=list(range(1, response + 1)),
            policy_version=version,
            token_policy_versions=tokens,
            score=score,
            prompt_ids=[7] * prompt,
        )
        for i in range(n)
    ]


async def setup(redis_url, incarnation=3, max_staleness=0):
    redis = connect(redis_url)
    keys = RunKeys(f"c-{uuid.uuid4().hex[:6]}")
    producer = trajectory_queue(redis, keys, "replica")
    learner = trajectory_queue(redis, keys, "learner-0")
    await learner.ensure_group()
    collector = BatchCollector(
        TrajectoryCollector(learner, keys.used_uids),
        n=2,
        incarnation=incarnation,
        max_staleness=max_staleness,
        validate=validate,
    )
    return redis, keys, producer, learner, collector


async def no_requeue(_t):
    raise AssertionError("nothing should be re-enqueued")


def test_group_uids_carry_the_incarnation():
    gid = group_uid(7, 3, 12)
    assert incarnation_of(gid) == 7 and gid.startswith("i7:s3:d12:")
    assert (step_of(gid), index_of(gid)) == (3, 12)
    assert incarnation_of("whatever") == step_of("whatever") == index_of("whatever") == -1
    assert (step_of("i7:sx:d1:ab"), index_of("i7:s3:d-1:ab")) == (-1, -1)


async def test_a_step_takes_whole_groups_and_leaves_the_rest_for_the_next(redis_url):
    redis, keys, producer, learner, collector = await setup(redis_url)
    a, b, c = (group_uid(3, 1, i) for i in range(3))
    await producer.put(group(a, 2) + group(b, 1))  # b is incomplete for now
    await producer.put(group(c, 2) + group(b, 2)[1:])
    batch = await collector.collect(2, version=1, timeout_s=30, requeue=no_requeue)
    got = {t.group_uid for t in batch.trajectories}
    assert len(batch.trajectories) == 4 and len(got) == 2 and got <= {a, b, c}
    left = ({a, b, c} - got).pop()
    await collector.commit(batch)
    assert await learner.pending() == 2  # the group left for the next step stays unacked
    nxt = await collector.collect(1, version=1, timeout_s=30, requeue=no_requeue)
    assert {t.group_uid for t in nxt.trajectories} == {left}
    await collector.commit(nxt, forget_uids=batch.uids)  # the first step's uids leave the used set
    assert await learner.length() == 0
    assert await redis.smembers(keys.used_uids) == {u.encode() for u in nxt.uids}
    await redis.aclose()


async def test_a_long_group_of_this_step_serves_the_next_and_a_later_steps_complete_group_this_one(
    redis_url,
):
    """The long tail: a step does not wait for its own slowest group when groups the feeder enqueued
    for a later step (max_staleness >= 1) are complete; the slow one is taken once it is."""
    redis, _, producer, _, collector = await setup(redis_url, max_staleness=1)
    slow, quick, ahead = group_uid(3, 1, 0), group_uid(3, 1, 1), group_uid(3, 2, 5)
    await producer.put(group(slow, 2)[:1] + group(quick, 2) + group(ahead, 2))
    batch = await collector.collect(2, version=1, timeout_s=30, requeue=no_requeue)
    assert {t.group_uid for t in batch.trajectories} == {quick, ahead}
    await collector.commit(batch)
    await producer.put(group(slow, 2)[1:])
    nxt = await collector.collect(1, version=2, timeout_s=30, requeue=no_requeue)
    assert [t.uid for t in nxt.trajectories] == [f"{slow}/0", f"{slow}/1"]
    await redis.aclose()


async def test_a_steps_rows_are_written_as_its_groups_complete(redis_url):
    """The batch is the one padded at once from the groups taken, in the order they completed:
    rows written before a longer group are padded out to it, rows of a group forgotten after they
    were written (a lost group) leave the batch, and what a call that timed out wrote is kept."""
    redis, _, producer, _, collector = await setup(redis_url)

    def new_batch():
        return BatchBuilder(0, rows=4, max_prompt_length=8, max_response_length=8, with_ref=False)

    async def collect(timeout_s):
        return await collector.collect(2, 1, timeout_s, no_requeue, new_batch=new_batch)

    a, b, c, d, e = (group_uid(3, 1, i) for i in range(5))
    await producer.put(group(a, 2, prompt=1, response=2) + group(b, 2, prompt=1, response=1)[:1])
    with pytest.raises(TimeoutError, match="only 1 of 2"):
        await collect(0.3)
    await producer.put(group(c, 2, prompt=5, response=6))
    step = await collect(30)
    assert step.groups == [a, c] and step.batch.uids == [t.uid for t in step.trajectories]
    assert (step.batch.prompt_length, step.batch.response_length) == (5, 6)
    want = build_batch(step.trajectories, 0, with_ref=False)
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "token_level_scores"):
        assert torch.equal(getattr(step.batch, name), getattr(want, name)), name
    await collector.commit(step)

    await producer.put(group(d, 2, prompt=3, response=7))
    with pytest.raises(TimeoutError):
        await collect(0.3)
    collector.drop_group(d)
    await producer.put(group(b, 2, prompt=1, response=1)[1:] + group(e, 2, prompt=2, response=3))
    step = await collect(30)
    assert step.groups == [b, e] and step.batch.uids == [f"{b}/0", f"{b}/1", f"{e}/0", f"{e}/1"]
    assert (step.batch.prompt_length, step.batch.response_length) == (2, 3)
    assert torch.equal(step.batch.input_ids, build_batch(step.trajectories, 0, with_ref=False).input_ids)
    await redis.aclose()


async def test_a_sample_that_joins_a_group_after_its_rows_were_written_is_in_the_batch(redis_url):
    """The batch always holds exactly the trajectories the step commits, more than the step's
    groups of n if a group has more."""
    redis, _, producer, _, collector = await setup(redis_url)

    def new_batch():  # rows for 2 groups of n=2, as the learner asks
        return BatchBuilder(0, rows=4, max_prompt_length=8, max_response_length=8, with_ref=False)

    a, b = group_uid(3, 1, 0), group_uid(3, 1, 1)
    await producer.put(group(a, 2, prompt=1, response=2))
    with pytest.raises(TimeoutError):
        await collector.collect(2, 1, 0.3, no_requeue, new_batch=new_batch)
    late = group(a, 3, prompt=2, response=3)[2]  # a third sample of a, under a uid of its own
    await producer.put([late, *group(b, 2, prompt=1, response=1)])
    step = await collector.collect(2, 1, 30, no_requeue, new_batch=new_batch)
    assert step.batch.uids == [t.uid for t in step.trajectories] and f"{a}/2" in step.batch.uids
    assert torch.equal(step.batch.input_ids, build_batch(step.trajectories, 0, with_ref=False).input_ids)
    await redis.aclose()


async def test_samples_of_weights_the_learner_never_had_are_refused_and_their_groups_requeued(redis_url):
    # A learner resumed from the checkpoint of v4 after its predecessor had pushed v5..v7 pushes as
    # v8: samples of v5..v7 (an engine that missed the push) and of versions past its own are not
    # of its policy's lineage, however fresh their number looks.
    redis, _keys, producer, _learner, collector = await setup(redis_url, max_staleness=4)
    collector.refused_versions = [(5, 7)]
    kept, rolled_back, ahead = group_uid(3, 5, 0), group_uid(3, 5, 1), group_uid(3, 5, 2)
    # Sampled from v4 into an in-place update: its second tokens came from v6, a refused version.
    crossed = group_uid(3, 5, 3)
    requeued = []

    async def requeue(t):
        requeued.append(t.group_uid)

    await producer.put(group(rolled_back, 2, version=7) + group(ahead, 2, version=9))
    await producer.put(group(crossed, 2, version=4, tokens=(4, 6)))
    await producer.put(group(kept, 1, version=4) + group(kept, 2, version=8)[1:])  # v4: before the checkpoint
    batch = await collector.collect(1, version=8, timeout_s=30, requeue=requeue)
    assert {t.group_uid for t in batch.trajectories} == {kept}
    assert sorted(requeued) == sorted([rolled_back, ahead, crossed])
    assert batch.counts["rolled_back_policy"] == 6 and batch.counts["stale"] == 0
    await redis.aclose()


async def test_stale_old_incarnation_invalid_and_duplicate_trajectories_are_filtered(redis_url):
    redis, _keys, producer, learner, collector = await setup(redis_url, max_staleness=1)
    fresh, stale, old, bad = group_uid(3, 5, 0), group_uid(3, 5, 1), group_uid(2, 5, 2), group_uid(3, 5, 3)
    requeued = []

    async def requeue(t):
        requeued.append(t.group_uid)

    await producer.put(group(fresh, 2, version=5) + group(stale, 2, version=3) + group(old, 2, version=5))
    await producer.put(group(bad, 1, version=5) + group(bad, 2, version=5, score=float("nan"))[1:])
    await producer.put(group(fresh, 2, version=5)[:1])  # a redelivered copy
    batch = await collector.collect(2, version=5, timeout_s=30, requeue=requeue)
    assert requeued == [stale]
    assert (
        batch.counts["stale"] == 2 and batch.counts["old_incarnation"] == 2 and batch.counts["invalid"] == 1
    )
    by_group = {}
    for t in batch.trajectories:
        by_group.setdefault(t.group_uid, []).append(t.uid)
    assert by_group == {fresh: [f"{fresh}/0", f"{fresh}/1"], bad: [f"{bad}/0"]}
    await collector.commit(batch)
    # Every entry the step consumed is acked, discarded ones included; the late duplicate is acked
    # as soon as it is claimed (while looking for a next batch that does not come).
    with pytest.raises(TimeoutError):
        await collector.collect(1, version=5, timeout_s=1, requeue=requeue)
    assert await learner.length() == 0 and await learner.pending() == 0
    assert await collector.collector.used([f"{fresh}/0", f"{bad}/1"]) == [True, True]
    await redis.aclose()


async def test_forged_and_bad_trajectories_are_dead_lettered_and_the_rest_of_the_batch_collected(redis_url):
    # The run has a token: its replicas sign. A forger with access to Redis but not the token sends
    # a better-scored copy of a sample of an outstanding group; a replica (a bug, a bad model) sends
    # a token id past the vocabulary and a score of 1e30. None of it is trained on; the step goes on.
    redis = connect(redis_url)
    keys = RunKeys.signed(f"v-{uuid.uuid4().hex[:6]}", "collect-token")
    producer = trajectory_queue(redis, keys, "replica")
    forger = trajectory_queue(redis, RunKeys(keys.run_id, signer_for("guess", keys.run_id)), "forger")
    learner = trajectory_queue(redis, keys, "learner-0")
    await learner.ensure_group()
    collector = BatchCollector(
        TrajectoryCollector(learner, keys.used_uids),
        n=2,
        incarnation=3,
        max_staleness=0,
        validate=functools.partial(
            validate_trajectory, vocab_size=32, max_prompt_length=4, max_response_length=4
        ),
    )
    a, b, c = (group_uid(3, 1, i) for i in range(3))
    forged = group(a, 1, score=100.0)
    await forger.put(forged)  # arrives first, for a group the learner waits for
    far_token, huge_score = group(b, 2), group(c, 2)
    far_token[1].response_ids[:] = [1, 32]
    huge_score[1].score = 1e30
    await producer.put(group(a, 2) + far_token + huge_score)

    batch = await collector.collect(3, version=1, timeout_s=30, requeue=no_requeue)
    assert sorted(t.uid for t in batch.trajectories) == [f"{a}/0", f"{a}/1", f"{b}/0", f"{c}/0"]
    assert all(t.score == 1.0 for t in batch.trajectories)  # the forger's 100.0 is not among them
    assert batch.counts["invalid"] == 2 and set(batch.groups) == {a, b, c}
    dead = {d.message.uid: d.reason for d in await learner.dead_letters()}
    assert dead[f"{a}/0"].startswith("bad_signature: ")
    assert dead[f"{b}/1"].startswith("invalid: response_ids: holds token id 32")
    assert dead[f"{c}/1"].startswith("invalid: score: 1e+30")
    await collector.commit(batch)
    assert await learner.length() == 0 and await learner.pending() == 0
    # The refused samples' uids are used: a later copy of them is not trained on either.
    assert await collector.collector.used([f"{b}/1", f"{c}/1"]) == [True, True]
    await redis.aclose()


async def test_collect_times_out_naming_what_is_missing(redis_url):
    redis, _keys, _producer, _learner, collector = await setup(redis_url)
    with pytest.raises(TimeoutError, match=r"only 0 of 3 prompt groups arrived"):
        await collector.collect(3, version=1, timeout_s=0.3, requeue=no_requeue)
    await redis.aclose()


async def feeder_on(redis_url, items, *, incarnation, extra=0, batch_size=3):
    from rlmesh.data import PromptCursor

    redis = connect(redis_url)
    queue = prompt_queue(redis, RunKeys(f"f-{uuid.uuid4().hex[:6]}"), "learner")
    await queue.ensure_group()
    cursor = PromptCursor(len(items), shuffle=True, seed=1)
    feeder = PromptFeeder(
        queue, items, cursor, batch_size=batch_size, n=2, incarnation=incarnation, extra=extra
    )
    return redis, queue, feeder


async def test_feeder_queues_at_most_staleness_plus_one_batches_and_restores_the_cursor(redis_url):
    items = prompt_items(10)
    redis, queue, feeder = await feeder_on(redis_url, items, incarnation=4)
    assert await feeder.ensure(1, version=0, max_staleness=1) == [1, 2]
    assert await feeder.ensure(1, version=0, max_staleness=1) == []
    assert await queue.length() == 6
    order = [int(i) for i in feeder.cursor.epoch_order(0)]
    tasks = [d.message for d in await queue.claim(6)]
    assert all(incarnation_of(t.group_uid) == 4 and t.n == 2 for t in tasks)
    assert [t.step for t in tasks] == [1, 1, 1, 2, 2, 2]
    assert [index_of(t.group_uid) for t in tasks] == order[:6]
    # Step 1 trained on its first two groups and one of step 2's (whichever were complete first).
    feeder.taken([tasks[0].group_uid, tasks[1].group_uid, tasks[4].group_uid])
    state = feeder.state_dict()
    assert state["prompts_in_flight"] == [order[2], order[3], order[5]]
    # A learner resumed from it enqueues those three first, then draws on past all six.
    redis2, queue2, resumed = await feeder_on(redis_url, items, incarnation=5)
    resumed.load_state_dict(state)
    assert await resumed.ensure(2, version=1, max_staleness=1) == [2, 3]
    again = [d.message for d in await queue2.claim(10)]
    assert [index_of(t.group_uid) for t in again] == [
        order[2],
        order[3],
        order[5],
        order[6],
        order[7],
        order[8],
    ]
    assert [t.step for t in again] == [2, 2, 2, 3, 3, 3] and all(
        incarnation_of(t.group_uid) == 5 for t in again
    )
    await redis.aclose()
    await redis2.aclose()


async def test_over_provisioning_keeps_extra_groups_in_flight_through_the_steps(redis_url):
    """APRIL: ``extra`` groups beyond the batches; each step takes a batch and tops the pool up by one."""
    items = prompt_items(40)
    redis, queue, feeder = await feeder_on(redis_url, items, incarnation=1, extra=2)
    await feeder.ensure(1, version=0, max_staleness=1)
    assert len(feeder.outstanding) == await queue.length() == 3 * 2 + 2
    assert [len(feeder.enqueued[s]) for s in (1, 2)] == [5, 3]
    drawn = [index_of(g) for g in feeder.outstanding]
    for step in range(2, 6):
        # The step before took any three in flight (the extras included); the window moves on by one batch.
        feeder.taken(list(feeder.outstanding)[1:4])
        assert await feeder.ensure(step, version=step - 1, max_staleness=1) == [step + 1]
        assert len(feeder.enqueued[step + 1]) == 3 and len(feeder.outstanding) == 8
        feeder.forget_before(step)
    order = [int(i) for i in feeder.cursor.epoch_order(0)]
    assert drawn == order[:8]
    assert feeder.cursor.position == 8 + 4 * 3  # nothing drawn twice or skipped
    await redis.aclose()


async def test_a_checkpoint_of_other_data_is_refused_naming_the_rows(redis_url):
    items = prompt_items(5)
    redis, _, feeder = await feeder_on(redis_url, items, incarnation=1)
    state = {"data_cursor": feeder.cursor.state_dict(), "prompts_in_flight": [1, 9]}
    with pytest.raises(ValueError, match=r"rows \[9\] outside the training set \(5 rows\)"):
        feeder.load_state_dict(state)
    assert feeder.carried == []
    await redis.aclose()
