"""``StreamQueue.interrupt``: a claim blocked in XREADGROUP is woken at once, and nothing added
after the wake can be handed to it."""

import asyncio

from rlmesh.queue import connect, prompt_queue
from rlmesh.v1 import trajectory_pb2
from tests.support.polling import eventually
from tests.support.streams import blocked_reads

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


async def test_interrupt_waits_for_the_id_of_a_read_redis_already_holds(redis, keys):
    """Redis can hold the read blocked before the claim has read back its connection's id (one
    write carries both): interrupt() cannot name it then, so it must wait for the claim to wake it."""
    producer = prompt_queue(redis, keys, "learner")
    replica = prompt_queue(redis, keys, "replica")
    await replica.ensure_group()
    id_reply_may_go = asyncio.Event()
    pool = replica.redis.connection_pool
    get_connection = pool.get_connection

    async def connection_that_holds_the_blocking_reads_id(*args, **kwargs):
        conn = await get_connection(*args, **kwargs)
        send_packed_command, read_response = conn.send_packed_command, conn.read_response

        async def send(command, *a, **k):
            await send_packed_command(command, *a, **k)
            written = b"".join(command if isinstance(command, list) else [command])
            if b"CLIENT" in written and b"BLOCK" in written:  # the blocking read, not CLIENT LIST
                conn.read_response = held
                pool.get_connection = get_connection

        async def held(*a, **k):
            conn.read_response = read_response  # only the first reply after the write: CLIENT ID's
            await id_reply_may_go.wait()
            return await read_response(*a, **k)

        conn.send_packed_command = send
        return conn

    pool.get_connection = connection_that_holds_the_blocking_reads_id
    claim = asyncio.create_task(replica.claim(5, block_ms=LONG_BLOCK_MS))
    await eventually(lambda: blocked_reads(redis), 1, "Redis to hold the read blocked")
    interrupting = asyncio.create_task(replica.interrupt())
    for _ in range(20):  # every other task gets its turns: interrupt() must still be waiting
        await asyncio.sleep(0)
    assert not interrupting.done()
    id_reply_may_go.set()
    await interrupting
    assert await blocked_reads(redis) == 0
    await producer.put(tasks("a"))
    assert await claim == [] and await replica.unread() == 1


async def test_interrupt_without_a_claim_in_progress_changes_nothing(redis, keys):
    producer = prompt_queue(redis, keys, "learner")
    replica = prompt_queue(redis, keys, "replica")
    await replica.ensure_group()
    await replica.interrupt()
    claim = asyncio.create_task(replica.claim(5, block_ms=LONG_BLOCK_MS))
    await eventually(lambda: blocked_reads(redis), 1, "the claim to block")
    await producer.put(tasks("a"))
    assert [d.message.uid for d in await claim] == ["a"]


async def test_without_the_client_command_claims_still_work_and_the_connection_stays_in_step(
    redis, redis_server, keys
):
    """A least-privilege ACL user (or a Redis-like server) may refuse CLIENT ID / CLIENT UNBLOCK:
    blocking claims then go on without early wakes, and no reply is left behind on a connection."""
    user = f"limited-{keys.run_id}"
    await redis.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-client")
    limited = connect(redis_server.url.replace("redis://", f"redis://{user}:pw@"))
    try:
        producer = prompt_queue(redis, keys, "learner")
        replica = prompt_queue(limited, keys, "replica")
        await replica.ensure_group()
        await producer.put(tasks("a"))
        assert [d.message.uid for d in await replica.claim(5, block_ms=100)] == ["a"]
        # Every later reply belongs to its own command (a reply left unread would shift them).
        assert await limited.ping() is True and await replica.pending() == 1
        claim = asyncio.create_task(replica.claim(5, block_ms=LONG_BLOCK_MS))
        await eventually(lambda: blocked_reads(redis), 1, "the claim to block")
        await replica.interrupt()  # cannot wake it, and does not fail
        await producer.put(tasks("b"))
        assert [d.message.uid for d in await claim] == ["b"]
        assert await limited.ping() is True and await replica.pending() == 2
    finally:
        await limited.aclose()
