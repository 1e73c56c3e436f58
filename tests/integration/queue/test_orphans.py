"""A consumer's own orphans (entries Redis handed it that the process never got) against a real
redis-server: taken back after ``claim_idle_ms``, and never confused with entries in work.

Idle times are set with ``XCLAIM ... IDLE`` instead of waited for, so nothing depends on timing:
``claim_idle_ms`` is far longer than a test runs, and an entry is idle past it only when a test
says so."""

from rlmesh.queue import ROLLOUT_GROUP, CollectedBatch, TrajectoryCollector, prompt_queue, trajectory_queue
from rlmesh.v1 import trajectory_pb2

IDLE_MS = 30_000
LONG_IDLE_MS = 10 * IDLE_MS


def tasks(n, prefix="t"):
    return [trajectory_pb2.PromptTask(uid=f"{prefix}{i}", group_uid=f"g{i}", n=1) for i in range(n)]


async def lose_reply(redis, stream, group, consumer, count=1):
    """What Redis does for an XREADGROUP whose reply a dropped connection lost: the entries are
    pending under ``consumer``, and the consumer's process never heard of them."""
    reply = await redis.xreadgroup(group, consumer, {stream: ">"}, count=count)
    [[_, entries]] = reply
    return [eid for eid, _ in entries]


async def make_idle(redis, stream, group, consumer, ids, retrycount=None):
    """Sets the entries' idle time past IDLE_MS (and their delivery count), keeping their owner."""
    await redis.xclaim(
        stream, group, consumer, 0, list(ids), idle=LONG_IDLE_MS, retrycount=retrycount, justid=True
    )


async def test_an_own_entry_whose_reply_was_lost_is_taken_back_once_idle(redis, keys):
    producer = prompt_queue(redis, keys, "learner")
    a = prompt_queue(redis, keys, "replica-a", claim_idle_ms=IDLE_MS)
    await a.ensure_group()
    assert await a.claim(10) == []  # a is up: its reads of own pending entries are over
    await producer.put(tasks(2))
    [lost] = await lose_reply(redis, keys.prompts, ROLLOUT_GROUP, "replica-a")
    # Still young: it might be in work, so it is not handed out again; the next entry is.
    assert [d.message.uid for d in await a.claim(10)] == ["t1"]
    assert await a.claim(10) == []
    await make_idle(redis, keys.prompts, ROLLOUT_GROUP, "replica-a", [lost])
    [back] = await a.claim(10)
    assert (back.entry_id, back.message.uid, back.deliveries) == (lost, "t0", 2)
    # Taken back, it is in work at a again: no other consumer gets it.
    assert await prompt_queue(redis, keys, "replica-b", claim_idle_ms=IDLE_MS).claim(10) == []
    await a.ack([back.entry_id])
    assert await a.claim(10) == []
    assert await a.pending() == 1  # t1, still in work


async def test_entries_in_work_are_never_handed_out_again_however_idle(redis, keys):
    producer = prompt_queue(redis, keys, "learner")
    a = prompt_queue(redis, keys, "replica-a", claim_idle_ms=IDLE_MS)
    await a.ensure_group()
    await producer.put(tasks(2))
    got = await a.claim(2)
    # Untouched for longer than claim_idle_ms, they are still a's: a never hands them out again.
    await make_idle(redis, keys.prompts, ROLLOUT_GROUP, "replica-a", [d.entry_id for d in got])
    assert await a.claim(10) == []
    # Another consumer does take them over: why a consumer with replicas must touch in time.
    b = prompt_queue(redis, keys, "replica-b", claim_idle_ms=IDLE_MS)
    assert sorted((d.message.uid, d.deliveries) for d in await b.claim(10)) == [("t0", 2), ("t1", 2)]
    # Acked or dead-lettered, an entry is no longer held: the set does not grow for ever.
    await a.ack([got[0].entry_id])
    await a.dead_letter(got[1].entry_id, got[1].message.SerializeToString(), "failed: test", 1)
    assert await a.length() == 0 and a._held == set()


async def test_the_learner_holding_trajectories_for_long_gets_no_second_copy(redis, keys):
    producer = trajectory_queue(redis, keys, "replica")
    learner = trajectory_queue(redis, keys, "learner-0", claim_idle_ms=IDLE_MS)
    await learner.ensure_group()
    collector = TrajectoryCollector(learner, keys.used_uids)
    await producer.put([trajectory_pb2.Trajectory(uid=f"g{i}/0", group_uid=f"g{i}") for i in range(3)])
    batch = await collector.collect_until(2, timeout_s=10)
    # The step takes long and nothing touches its trajectories.
    await make_idle(redis, keys.trajectories, "learner", "learner-0", batch.entry_ids)
    # One claim round that asks for more than is new: only the new one comes.
    later = await collector.collect(CollectedBatch(), want=3, block_ms=10)
    assert later.uids == ["g2/0"] and later.duplicates == 0
    assert await learner.pending() == 3  # nothing acked before its commit
    await collector.commit(batch)
    await collector.commit(later)
    assert learner._held == set() and await learner.length() == 0


async def test_an_orphan_lost_too_often_goes_to_the_dead_letters(redis, keys):
    producer = prompt_queue(redis, keys, "learner")
    a = prompt_queue(redis, keys, "replica-a", claim_idle_ms=IDLE_MS, max_deliveries=3)
    await a.ensure_group()
    assert await a.claim(10) == []
    await producer.put(tasks(2))
    last_chance, poison = await lose_reply(redis, keys.prompts, ROLLOUT_GROUP, "replica-a", count=2)
    await make_idle(redis, keys.prompts, ROLLOUT_GROUP, "replica-a", [last_chance], retrycount=2)
    await make_idle(redis, keys.prompts, ROLLOUT_GROUP, "replica-a", [poison], retrycount=3)
    [back] = await a.claim(10)
    assert (back.message.uid, back.deliveries) == ("t0", 3)
    [dead] = await a.dead_letters()
    assert (dead.entry_id, dead.message.uid) == (poison, "t1")
    assert dead.reason.startswith("redelivered: handed out 4 times without an ack (max_deliveries=3)")
    assert await a.length() == 1 and await a.pending() == 1


async def test_a_restarted_consumer_hands_out_each_own_pending_entry_once(redis, keys):
    producer = prompt_queue(redis, keys, "learner")
    before = prompt_queue(redis, keys, "replica-a")
    await before.ensure_group()
    await redis.xadd(keys.prompts, {b"p": b"\xff\xfe not a protobuf"})
    await producer.put(tasks(2))
    assert [d.message.uid for d in await before.claim(10)] == ["t0", "t1"]  # the poison one: dead
    await redis.xadd(keys.prompts, {b"p": b"\xff\xfe not a protobuf either"})
    await lose_reply(redis, keys.prompts, ROLLOUT_GROUP, "replica-a")  # pending, undecodable
    await producer.put(tasks(1, prefix="t2-"))
    assert [d.message.uid for d in await before.claim(10)] == ["t2-0"]
    await producer.put(tasks(1, prefix="new"))
    # The process restarts under the same name: its pending entries come first, each once, in
    # reads of at most `count`; a poison one among them does not let a new entry in early.
    after = prompt_queue(redis, keys, "replica-a")
    uids = [[d.message.uid for d in await after.claim(2)] for _ in range(4)]
    assert uids == [["t0", "t1"], ["t2-0"], ["new0"], []]
    assert [d.reason.split(":")[0] for d in await after.dead_letters()] == ["undecodable", "undecodable"]
