"""One learner per run id: ``RunLease`` against a real redis-server."""

import asyncio
import json
import math
import os
import socket
import subprocess
import sys

import pytest

from rlmesh.queue.lease import LeaseHeldError, RunLease


async def test_a_second_holder_is_refused_while_the_first_renews(redis, keys):
    key = keys.scoped("learner_lease")
    first = RunLease(redis, key, lease_s=0.3)
    await first.acquire()
    keeper = asyncio.create_task(first.keep())
    second = RunLease(redis, key, lease_s=0.3)
    second.token = '{"host": "other", "pid": 2}'
    with pytest.raises(LeaseHeldError, match=r"held by another learner \(.*\"pid\": "):
        await second.acquire(wait_s=1.0)  # three leases: only renewals keep it
    keeper.cancel()
    await first.release()
    await second.acquire(wait_s=0)  # released: taken at once
    assert await redis.get(key) == second.token.encode()


async def test_a_dead_holders_lease_runs_out_and_is_taken(redis, keys):
    key = keys.scoped("learner_lease")
    await RunLease(redis, key, lease_s=0.2).acquire()  # never renewed: a holder killed with -9
    late = RunLease(redis, key, lease_s=0.2)
    late.token = "late"
    await late.acquire(wait_s=5)
    assert await redis.get(key) == b"late"


async def test_a_holder_learns_it_lost_the_key_and_takes_back_an_expired_one(redis, keys):
    key = keys.scoped("learner_lease")
    lease = RunLease(redis, key, lease_s=0.15)
    await lease.acquire()
    await redis.delete(key)  # expired while Redis was away: the next renewal takes it back
    keeper = asyncio.create_task(lease.keep())
    while await redis.pttl(key) < 0:
        await asyncio.sleep(0.01)
    assert await redis.get(key) == lease.token.encode() and not lease.lost
    await redis.set(key, "someone else")
    await asyncio.wait_for(keeper, timeout=5)  # returns once it sees another holder
    assert lease.lost


def holder_token(host: str, pid: int) -> str:
    return json.dumps({"host": host, "pid": pid, "since": 0})


async def test_a_dead_process_of_this_host_loses_its_lease_at_once(redis, keys):
    key = keys.scoped("learner_lease")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    await redis.set(key, holder_token(socket.gethostname(), gone.pid), px=60_000)
    successor = RunLease(redis, key, lease_s=60)
    await successor.acquire(wait_s=0)  # a minute's lease, not waited out
    assert await redis.get(key) == successor.token.encode()


@pytest.mark.parametrize("where", ["live here", "dead elsewhere", "not a holder"])
async def test_a_live_holder_or_one_of_another_host_keeps_its_lease(redis, keys, where):
    key = keys.scoped("learner_lease")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    value = {
        "live here": holder_token(socket.gethostname(), os.getppid()),
        "dead elsewhere": holder_token(f"not-{socket.gethostname()}", gone.pid),
        "not a holder": "someone",
    }[where]
    await redis.set(key, value, px=60_000)
    with pytest.raises(LeaseHeldError):
        await RunLease(redis, key, lease_s=60).acquire(wait_s=0)
    assert await redis.get(key) == value.encode()


async def test_a_standby_waits_past_many_leases_and_takes_the_key_once_released(redis, keys):
    key = keys.scoped("learner_lease")
    holder = RunLease(redis, key, lease_s=0.2)
    await holder.acquire()
    keeper = asyncio.create_task(holder.keep())
    standby = RunLease(redis, key, lease_s=0.2)
    standby.token = holder_token("standby", 1)
    waiting = asyncio.create_task(standby.acquire(wait_s=math.inf))
    # Twenty leases, far past the 1.5 a learner waits: the standby is still waiting, not refused.
    for _ in range(20):
        await asyncio.sleep(0.2)
        assert await redis.get(key) == holder.token.encode()
    assert not waiting.done()
    keeper.cancel()
    await holder.release()
    assert await asyncio.wait_for(waiting, timeout=10) is True
    assert await redis.get(key) == standby.token.encode()


async def test_a_standby_told_to_stop_gives_up_its_wait_without_the_key(redis, keys):
    key = keys.scoped("learner_lease")
    await redis.set(key, holder_token(f"not-{socket.gethostname()}", 1), px=60_000)
    stop = asyncio.Event()
    waiting = asyncio.create_task(
        RunLease(redis, key, lease_s=60).acquire(wait_s=math.inf, stopped=stop.is_set)
    )
    await asyncio.sleep(0)
    stop.set()
    assert await asyncio.wait_for(waiting, timeout=10) is False
    assert await redis.get(key) == holder_token(f"not-{socket.gethostname()}", 1).encode()
