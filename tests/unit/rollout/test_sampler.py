"""``SamplerLoop.pause`` against a scripted prompt queue: it returns only once no claim is in
progress, and what the last claim got is in flight by then. (Real Redis: tests/integration.)"""

import asyncio
import contextlib

import pytest

from rlmesh.queue.streams import Delivery
from rlmesh.rollout.resilience import CircuitBreaker
from rlmesh.rollout.sampler import SamplerLoop, SamplerSettings, oldest_version, token_versions
from rlmesh.v1 import trajectory_pb2


class ScriptedQueue:
    """A prompt queue whose claim waits until the test answers it, or ``interrupt`` ends it with
    nothing (as Redis answers a woken XREADGROUP)."""

    def __init__(self) -> None:
        self.claims = 0
        self.interrupts = 0
        self.claiming = asyncio.Event()  # set when a claim starts
        self.released: list[bytes] = []
        self._answer: asyncio.Future | None = None

    async def ensure_group(self) -> None:
        pass

    async def touch(self, entry_ids) -> None:
        pass

    def forget(self, entry_ids) -> None:
        pass

    async def release(self, entry_ids) -> None:
        self.released += entry_ids

    async def claim(self, count, block_ms=None):
        self.claims += 1
        self._answer = asyncio.get_running_loop().create_future()
        self.claiming.set()
        return await self._answer

    def answer(self, deliveries) -> None:
        self._answer.set_result(deliveries)

    async def interrupt(self) -> None:
        self.interrupts += 1
        if self._answer is not None and not self._answer.done():
            self._answer.set_result([])


class StalledEngine:
    """Keeps every task in flight: generation never starts."""

    async def model_info(self):
        await asyncio.Event().wait()


async def never(_samples):
    raise AssertionError("not reached: the engine never answers")


@pytest.fixture
async def sampler():
    queue = ScriptedQueue()
    loop = SamplerLoop(
        prompts=queue,
        trajectories=None,
        engine=StalledEngine(),
        score=never,
        ref_logprobs=None,
        settings=SamplerSettings(replica_id="r", touch_interval_s=3600),
        reward_breaker=CircuitBreaker("reward"),
        reference_breaker=CircuitBreaker("reference"),
    )
    run = asyncio.create_task(loop.run())
    await queue.claiming.wait()
    yield loop, queue
    await loop.stop(0)
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run


async def test_pause_wakes_a_blocked_claim_and_returns_once_it_ended(sampler):
    loop, queue = sampler
    assert loop.claim_in_progress
    await loop.pause()
    assert queue.interrupts == 1 and not loop.claim_in_progress and loop.paused
    assert queue.claims == 1 and loop.in_flight == 0

    queue.claiming.clear()
    loop.resume()
    await queue.claiming.wait()
    assert queue.claims == 2


async def test_tasks_the_last_claim_got_are_in_flight_when_pause_returns(sampler):
    loop, queue = sampler
    # Redis answered the read before the wake could reach it: the claim returns a task.
    queue.answer([Delivery(entry_id=b"1-0", message=trajectory_pb2.PromptTask(uid="a", n=1), deliveries=1)])
    await loop.pause()
    assert loop.in_flight == 1 and not loop.claim_in_progress and queue.claims == 1
    # Stopping gives up on it at once (no grace) and hands it back for another replica.
    assert await loop.stop(0) == 1
    assert queue.released == [b"1-0"] and loop.in_flight == 0


def out(ids, at_end, versions=None):
    meta = {"weight_version": at_end}
    if versions is not None:
        meta["output_token_weight_versions"] = versions
    return {"output_ids": ids, "meta_info": meta}


def test_each_token_keeps_the_version_that_sampled_it_and_the_oldest_tags_the_response():
    crossed = out([4, 5, 6], "5", ["3", "3", "5"])  # an in-place update after two tokens
    assert token_versions(crossed) == [3, 3, 5]
    assert oldest_version(crossed, token_versions(crossed), version_before=2) == 3
    # An engine that says nothing per token (SGLang), or says it for other tokens: the older of the
    # version as generation started and the one at the end, for every token.
    for silent in (out([4, 5, 6], "5"), out([4, 5, 6], "5", ["5"])):
        assert token_versions(silent) == []
        assert oldest_version(silent, [], version_before=4) == 4
        assert oldest_version(silent, [], version_before=0) == 5  # 0: not known
