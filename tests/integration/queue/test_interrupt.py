"""``StreamQueue.interrupt``: a claim blocked in XREADGROUP is woken at once, and nothing added
after the wake can be handed to it."""

import asyncio

from rlmesh.queue import prompt_queue
from rlmesh.v1 import trajectory_pb2
from tests.helpers import blocked_reads, eventually

# Far longer than the test: a claim that returns did so because it was woken.
LONG_BLOCK_MS = 20_000


def tasks(*uids):
    return [trajectory_pb2.PromptTask(uid=uid, n=1, prompt_ids=[1]) for uid in uids]


async def test_interrupt_wakes_a_blocked_claim_and_later_entries_wait_for_the_next(redis, keys):
    producer = prompt_queue(redis, keys, "learner")
    replica = prompt_queue(redis, keys, "replica")
    await replica.ensure_group()
    claim = asyncio.create_task(replica.claim(5, block_ms=LONG_BLOCK_MS))
    await eventually(lambda: blocked_reads(redis), 1, "the claim to block on the empty stream")

    await replica.interrupt()
    # Redis has ended the read by the time interrupt() returns, so an entry added now stays
    # unread: a read still blocked would be handed it before put() is even answered.
    assert await blocked_reads(redis) == 0
    await producer.put(tasks("a", "b"))
    assert await claim == []
    assert await replica.pending() == 0 and await replica.unread() == 2

    # Only the claim in progress was interrupted: the next one (its connection back in the pool,
    # reused) gets the entries, and blocks as usual on an empty stream.
    got = await replica.claim(5, block_ms=LONG_BLOCK_MS)
    assert [d.message.uid for d in got] == ["a", "b"] and await replica.pending() == 2
    await replica.ack([d.entry_id for d in got])
    claim = asyncio.create_task(replica.claim(5, block_ms=LONG_BLOCK_MS))
    await eventually(lambda: blocked_reads(redis), 1, "the next claim to block")
    await producer.put(tasks("c"))
    assert [d.message.uid for d in await claim] == ["c"]


async def test_interrupt_without_a_claim_in_progress_changes_nothing(redis, keys):
    producer = prompt_queue(redis, keys, "learner")
    replica = prompt_queue(redis, keys, "replica")
    await replica.ensure_group()
    await replica.interrupt()
    claim = asyncio.create_task(replica.claim(5, block_ms=LONG_BLOCK_MS))
    await eventually(lambda: blocked_reads(redis), 1, "the claim to block")
    await producer.put(tasks("a"))
    assert [d.message.uid for d in await claim] == ["a"]
