"""A typed work queue on a Redis Stream with a consumer group: at-least-once delivery; an entry
without a good tag, oversized, undecodable or redelivered too often is dead-lettered unread.
docs/reliability.md#streams"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError, Message
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError, ResponseError

from rlmesh.queue.signing import INVALID, UNDECODABLE, UNSIGNED, UNTRUSTED, Signer
from rlmesh.runtime.prometheus import MetricSet

log = logging.getLogger("rlmesh.queue")
# How long interrupt() waits for a claim's connection id that is on its way back.
_ID_REPLY_WAIT_S = 5.0

M = TypeVar("M", bound=Message)

PAYLOAD = b"p"
TAG = b"s"  # the payload's tag (signing.Signer.tag over the stream name and the payload)
DEAD_LETTER_MAXLEN = 100_000
# The largest payload a consumer decodes. A trajectory of 32k prompt and 32k response tokens with
# both log-probs is under 1 MiB; 64 MiB (the gRPC request limit's default) leaves room for long
# texts and still bounds what one entry can make a consumer hold in memory.
MAX_PAYLOAD_BYTES = 64 << 20

# Check-and-add in one step so concurrent producers cannot overshoot maxlen together. ARGV: maxlen,
# then a payload and its tag per entry (an empty tag: the entry goes unsigned).
_PUT_SCRIPT = """
local n = (#ARGV - 1) / 2
local maxlen = tonumber(ARGV[1])
local len = redis.call('XLEN', KEYS[1])
if len + n > maxlen then
  return redis.error_reply('QUEUE_FULL ' .. len .. ' ' .. n .. ' ' .. maxlen)
end
local ids = {}
for i = 1, n do
  local payload, tag = ARGV[2 * i], ARGV[2 * i + 1]
  if tag == '' then
    ids[i] = redis.call('XADD', KEYS[1], '*', 'p', payload)
  else
    ids[i] = redis.call('XADD', KEYS[1], '*', 'p', payload, 's', tag)
  end
end
return ids
"""


class QueueFullError(RuntimeError):
    """Adding would take a stream past its bound; nothing was added."""


@dataclass
class Delivery(Generic[M]):
    entry_id: bytes
    message: M
    # How many times the entry has been handed to a consumer, this time included.
    deliveries: int


@dataclass
class DeadLetter(Generic[M]):
    entry_id: bytes  # the entry's id in its own stream
    reason: str
    message: M | None  # None when the payload was missing or undecodable


@dataclass(eq=False)
class _Claim:
    """One ``claim`` in progress, as ``interrupt`` sees it."""

    interrupted: bool = False
    # The server-side id of the connection while it is in (or about to be in) its blocking read.
    client_id: int | None = None
    # Set while the read is on its way and its id not read back yet: Redis may already hold it
    # blocked, and only the claim itself can wake it once the id arrives.
    id_on_its_way: asyncio.Event | None = None


class QueueMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # registry=None keeps the counters unregistered (tests, several queues in one process).
        series = MetricSet(registry)
        self.enqueued = series.counter("rlmesh_queue_enqueued", "Messages added", ["stream"])
        self.delivered = series.counter(
            "rlmesh_queue_delivered", "Messages handed to this consumer", ["stream", "how"]
        )
        self.acked = series.counter("rlmesh_queue_acked", "Messages acknowledged", ["stream"])
        self.dead_lettered = series.counter(
            "rlmesh_queue_dead_lettered", "Messages moved to dead letters", ["stream", "reason"]
        )
        self.full = series.counter(
            "rlmesh_queue_full", "put() calls refused because the stream was full", ["stream"]
        )


class StreamQueue(Generic[M]):
    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        group: str,
        consumer: str,
        message_type: type[M],
        *,
        maxlen: int,
        dead_letter_stream: str,
        max_deliveries: int = 3,
        claim_idle_ms: int = 60_000,
        metrics: QueueMetrics | None = None,
        signer: Signer | None = None,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        """``signer``: tags what ``put`` adds and checks what ``claim`` hands out (None: neither);
        ``max_payload_bytes``: larger entries are dead-lettered undecoded."""
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.redis = redis
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.message_type = message_type
        self.maxlen = maxlen
        self.dead_letter_stream = dead_letter_stream
        self.max_deliveries = max_deliveries
        self.claim_idle_ms = claim_idle_ms
        self.metrics = metrics
        self.signer = signer
        self.max_payload_bytes = max_payload_bytes
        self._put = redis.register_script(_PUT_SCRIPT)
        self._read_own_pending = True
        # Where the read of own pending entries goes on: each read starts after the last entry the
        # one before returned, or it would hand the same entries out again while they are in work.
        self._own_pending_after = b"0"
        # Entries claim() returned and that were not acked, dead-lettered or forgotten since: this
        # process knows of them, so _reclaim never hands them out again (not orphans).
        self._held: set[bytes] = set()
        self._label = stream.rsplit(":", 1)[-1]
        self._claims: set[_Claim] = set()
        self._wakeable = True  # False once the server refused CLIENT ID
        self._next_wide_reclaim = 0.0  # monotonic time of the next reclaim that looks past held entries

    async def ensure_group(self) -> None:
        """Creates the stream and its consumer group (from the first entry) if missing."""
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def put(self, messages: Sequence[M]) -> list[bytes]:
        """Adds messages in order; all or none. Raises ``QueueFullError`` past ``maxlen``."""
        if not messages:
            return []
        args: list[bytes | int] = [self.maxlen]
        for m in messages:
            payload = m.SerializeToString()
            args += [payload, self.signer.tag(self.stream, payload) if self.signer else b""]
        try:
            ids = await self._put(keys=[self.stream], args=args)
        except ResponseError as e:
            if str(e).startswith("QUEUE_FULL"):
                _, length, adding, maxlen = str(e).split()
                if self.metrics:
                    self.metrics.full.labels(self._label).inc()
                raise QueueFullError(
                    f"stream {self.stream} holds {length} unfinished entries; adding {adding} would exceed its "
                    f"bound of {maxlen} (rlmesh.queue.*_stream_maxlen): the consumers are not keeping up"
                ) from None
            raise
        if self.metrics:
            self.metrics.enqueued.labels(self._label).inc(len(messages))
        return list(ids)

    async def claim(self, count: int, block_ms: int | None = None) -> list[Delivery[M]]:
        """Up to ``count`` entries for this consumer; waits up to ``block_ms`` only when none is ready.
        ``interrupt`` makes it return early with what it has got so far."""
        claim = _Claim()
        self._claims.add(claim)
        try:
            out: list[Delivery[M]] = []
            more_own_pending = False
            if self._read_own_pending:
                entries = await self._read(count, self._own_pending_after, None)
                if entries:
                    self._own_pending_after = entries[-1][0]
                # A full read: more may follow, and the next claim reads on from here.
                self._read_own_pending = more_own_pending = len(entries) == count
                out += await self._accept(entries, "own_pending", await self._delivery_counts(entries))
            # While own pending entries may be left to read, the next claim reads them first and
            # this one takes nothing else (fewer than count, when some were poison): a reclaim or a
            # new read now would hand out own entries that the next read returns again.
            if len(out) < count and not claim.interrupted and not more_own_pending:
                out += await self._reclaim(count - len(out))
            if len(out) < count and not claim.interrupted and not more_own_pending:
                if out or block_ms is None:
                    entries = await self._read(count - len(out), ">", None)
                else:
                    entries = await self._read_blocking(count, block_ms, claim)
                out += await self._accept(entries, "new", {eid: 1 for eid, _ in entries})
            # Only now: entries of a claim that raised never reach the caller, so they stay
            # orphans that a later claim takes back after claim_idle_ms.
            self._held.update(d.entry_id for d in out)
            return out
        finally:
            self._claims.discard(claim)

    async def interrupt(self) -> None:
        """Ends the claims in progress as soon as it can: one that has not reached its blocking wait
        skips it and reads no new entries, one in it is woken (CLIENT UNBLOCK: Redis answers it as if
        ``block_ms`` had run out). Each returns the entries it had been handed by then: none is lost.
        Claims that start later are not affected.

        It does not wait for them to return, only for their wakes: when it returns each blocked read
        is over server-side (nothing more can be handed to it). A read whose connection's id has not
        come back within a few seconds (a server that stopped answering) ends after its
        ``block_ms``."""
        claims = list(self._claims)
        for claim in claims:  # all first: a wake below may take a round trip
            claim.interrupted = True
        for claim in claims:
            on_its_way = claim.id_on_its_way
            if claim.client_id is None and on_its_way is not None:
                # The read may be blocked in Redis already: the claim wakes it itself once its id
                # is read back (the same write, so at once from a live server).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(on_its_way.wait(), _ID_REPLY_WAIT_S)
            elif claim.client_id is not None:
                try:
                    await self.redis.client_unblock(claim.client_id)
                except ResponseError as e:  # say, an ACL without CLIENT: it ends after block_ms
                    log.warning("could not wake a blocked claim on %s: %s", self.stream, e)

    async def ack(self, entry_ids: Sequence[bytes]) -> None:
        """Acknowledges and deletes; acking an entry twice is harmless."""
        if not entry_ids:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.xdel(self.stream, *entry_ids)
            await pipe.execute()
        self.forget(entry_ids)
        if self.metrics:
            self.metrics.acked.labels(self._label).inc(len(entry_ids))

    def forget(self, entry_ids: Sequence[bytes]) -> None:
        """Tells the queue that entries it handed out were acked by other means (the learner acks
        in the transaction that marks their uids used); ``ack`` and ``dead_letter`` do it
        themselves. Until then ``claim`` treats them as held by this process."""
        self._held.difference_update(entry_ids)

    async def dead_letter(
        self,
        entry_id: bytes,
        payload: bytes | None,
        reason: str,
        deliveries: int,
        tag: bytes | None = None,
    ) -> None:
        """Moves an entry to the dead-letter stream with the reason, atomically with its ack.
        ``tag``: the entry's own, kept so that a replay is checked as the entry was (a replay can
        never make a forged entry pass)."""
        log.error("dead-lettering %s %s: %s", self.stream, entry_id, reason)
        fields: dict[bytes, bytes | str | int] = {
            b"stream": self.stream,
            b"entry_id": entry_id,
            b"reason": reason,
            b"deliveries": deliveries,
            PAYLOAD: payload or b"",
        }
        if tag:
            fields[TAG] = tag
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.dead_letter_stream, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
            pipe.xack(self.stream, self.group, entry_id)
            pipe.xdel(self.stream, entry_id)
            await pipe.execute()
        self.forget([entry_id])
        if self.metrics:
            self.metrics.dead_lettered.labels(self._label, reason.split(":", 1)[0]).inc()

    async def dead_letter_message(self, entry_id: bytes, message: M, reason: str, deliveries: int) -> None:
        """Dead-letters an entry ``claim`` handed out (so one the signer vouched for) that its
        consumer cannot use: tagged afresh, so a replay is refused for its reason again, not as
        unsigned. Never for an entry ``claim`` refused: that one keeps the tag it came with."""
        payload = message.SerializeToString()
        tag = self.signer.tag(self.stream, payload) if self.signer else None
        await self.dead_letter(entry_id, payload, reason, deliveries, tag)

    async def length(self) -> int:
        """Entries not yet acknowledged (waiting or being worked on)."""
        return int(await self.redis.xlen(self.stream))

    async def pending(self) -> int:
        """Entries handed to a consumer and not yet acknowledged."""
        summary = await self.redis.xpending(self.stream, self.group)
        return int(summary["pending"])

    async def unread(self) -> int:
        """Entries no consumer has been handed yet."""
        return await self.length() - await self.pending()

    async def dead_letters(self, count: int = 1000) -> list[DeadLetter[M]]:
        """This stream's dead letters among the newest ``count`` of the dead-letter stream, newest
        first."""
        out: list[DeadLetter[M]] = []
        for _, fields in await self.redis.xrevrange(self.dead_letter_stream, count=count):
            if fields.get(b"stream", b"").decode(errors="replace") != self.stream:
                continue
            message = None
            with contextlib.suppress(DecodeError):
                if fields.get(PAYLOAD):
                    message = self.message_type.FromString(fields[PAYLOAD])
            out.append(
                DeadLetter(
                    entry_id=fields.get(b"entry_id", b""),
                    reason=fields.get(b"reason", b"").decode(errors="replace"),
                    message=message,
                )
            )
        return out

    async def _read(self, count: int, start: str, block_ms: int | None) -> list[tuple[bytes, dict | None]]:
        reply = await self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: start}, count=count, block=block_ms
        )
        return _entries(reply)

    async def _read_blocking(
        self, count: int, block_ms: int, claim: _Claim
    ) -> list[tuple[bytes, dict | None]]:
        """XREADGROUP BLOCK for new entries, woken early by ``interrupt``. To wake it, ``interrupt``
        needs the id Redis gave this connection: CLIENT ID goes out in the same write as the read, so
        knowing it costs no round trip. Both replies are read off one pooled connection here, which is
        what redis-py does for a pipeline (its retry and disconnect-on-error included)."""
        if not self._wakeable:
            return await self._read(count, ">", block_ms)
        pool = self.redis.connection_pool
        conn = await pool.get_connection()
        read_new = ("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, "BLOCK", block_ms)
        commands = conn.pack_commands([("CLIENT", "ID"), (*read_new, "STREAMS", self.stream, ">")])

        async def read() -> object:
            claim.client_id = None
            if claim.interrupted:
                return None
            claim.id_on_its_way = on_its_way = asyncio.Event()
            try:
                await conn.send_packed_command(commands)
                try:
                    client_id: int | None = int(await conn.read_response())
                except ResponseError as e:
                    # CLIENT refused (an ACL user without @admin, a Redis-like server): the read
                    # below still runs; from now on claims read without wake support (Pause waits
                    # them out).
                    log.warning(
                        "CLIENT ID refused on %s (%s): blocked claims cannot be woken early", self.stream, e
                    )
                    self._wakeable, client_id = False, None
                claim.client_id = client_id
                if claim.interrupted and client_id is not None:
                    # interrupt() came while the commands were on their way and could not name this
                    # connection yet: wake it from here. Redis ran the read along with CLIENT ID
                    # (one write), so it is blocked now, or already answered. Best effort: the
                    # reply must still be read below whatever happens to the wake.
                    with contextlib.suppress(RedisError):
                        await self.redis.client_unblock(client_id)
            finally:
                claim.id_on_its_way = None
                on_its_way.set()
            return await conn.read_response()

        async def reconnect(error: Exception) -> None:
            await conn.disconnect(error=error)

        try:
            # A connection error is retried like any command.
            reply = await conn.retry.call_with_retry(read, reconnect)
        except BaseException:
            # Cancelled, or an error with a reply possibly still on its way: this connection must
            # not go back to the pool in the middle of an exchange.
            await conn.disconnect()
            raise
        finally:
            claim.client_id = None
            await pool.release(conn)
        return _entries(self.redis.response_callbacks["XREADGROUP"](reply))

    async def _reclaim(self, count: int) -> list[Delivery[M]]:
        """Claims entries left idle past ``claim_idle_ms``: other consumers' (dead, or too slow to
        touch them), and this consumer's own orphans. Never one this object handed out and still
        holds. Not XAUTOCLAIM: that would also hand a live consumer its own slow entries again.

        An own entry that is idle and not held cannot be in work here: the only way to work on an
        entry is to get it from ``claim``. (A second process under the same consumer name, which
        ``touch``-es its entries as a consumer with replicas must, keeps them from looking idle.)"""
        # Held entries idle past claim_idle_ms are in the reply too (the learner holds trajectories
        # for a step or more untouched) and could hide others, so now and then the window covers
        # them all — not on every claim: that can be thousands of rows, claims come every 200 ms,
        # and a reclaim only has to happen within about claim_idle_ms.
        window = count * 4 + 16
        now = time.monotonic()
        if self._held and now >= self._next_wide_reclaim:
            window += len(self._held)
            self._next_wide_reclaim = now + self.claim_idle_ms / 4000
        rows = await self.redis.xpending_range(
            self.stream, self.group, min="-", max="+", count=window, idle=self.claim_idle_ms
        )
        rows = [row for row in rows if row["message_id"] not in self._held][:count]
        if not rows:
            return []
        ids = [row["message_id"] for row in rows]
        own = {row["message_id"] for row in rows if row["consumer"].decode(errors="replace") == self.consumer}
        # XCLAIM re-checks the idle time, so two consumers racing for one entry cannot both win,
        # and counts a delivery, so an entry that keeps getting lost ends in the dead letters.
        entries = await self.redis.xclaim(self.stream, self.group, self.consumer, self.claim_idle_ms, ids)
        # An entry deleted while pending comes back without fields and is acked in _accept.
        entries = [(eid, fields) for eid, fields in entries]
        counts = await self._delivery_counts(entries)
        orphans = [(eid, fields) for eid, fields in entries if eid in own]
        others = [(eid, fields) for eid, fields in entries if eid not in own]
        if orphans:
            log.warning(
                "took back %d entries of %s pending under this consumer's name (%s) that this process "
                "never got (a reply lost to a connection drop)",
                len(orphans),
                self.stream,
                self.consumer,
            )
        if others:
            log.warning("reclaimed %d idle entries of %s from other consumers", len(others), self.stream)
        out = await self._accept(others, "reclaimed", counts)
        return out + await self._accept(orphans, "orphaned", counts)

    async def touch(self, entry_ids: Sequence[bytes]) -> None:
        """Resets the idle time of entries this consumer is still working on (long generations),
        so others do not reclaim them; the delivery count is unchanged."""
        if entry_ids:
            await self.redis.xclaim(self.stream, self.group, self.consumer, 0, list(entry_ids), justid=True)

    async def release(self, entry_ids: Sequence[bytes]) -> None:
        """Gives back entries this consumer will not finish (it is stopping, or its engine died):
        they are made to look idle past ``claim_idle_ms`` so another consumer's next claim takes
        them over now rather than after the timeout; the delivery count is unchanged."""
        if entry_ids:
            await self.redis.xclaim(
                self.stream,
                self.group,
                self.consumer,
                0,
                list(entry_ids),
                idle=2 * self.claim_idle_ms + 1000,
                justid=True,
            )
        self.forget(entry_ids)

    async def _delivery_counts(self, entries: Sequence[tuple[bytes, object]]) -> dict[bytes, int]:
        if not entries:
            return {}
        ids = [eid for eid, _ in entries]
        rows = await self.redis.xpending_range(
            self.stream,
            self.group,
            min=min(ids),
            max=max(ids),
            count=len(ids) * 4 + 16,
            consumername=self.consumer,
        )
        wanted = set(ids)
        counts = {
            row["message_id"]: int(row["times_delivered"]) for row in rows if row["message_id"] in wanted
        }
        return {eid: counts.get(eid, 1) for eid in ids}

    async def _accept(
        self, entries: Sequence[tuple[bytes, dict | None]], how: str, deliveries: dict[bytes, int]
    ) -> list[Delivery[M]]:
        out: list[Delivery[M]] = []
        for eid, fields in entries:
            n = deliveries.get(eid, 1)
            if not fields:
                # Deleted while pending (already acked elsewhere): nothing left to do.
                await self.ack([eid])
                continue
            payload, tag = fields.get(PAYLOAD), fields.get(TAG)
            if payload is None:
                UNTRUSTED.count(self._label, UNDECODABLE, f"{self.stream} {eid!r} has no payload")
                await self.dead_letter(eid, None, f"malformed: entry has no '{PAYLOAD.decode()}' field", n)
                continue
            problem = self._untrusted(payload, tag)
            if problem is not None:
                cause, reason = problem
                UNTRUSTED.count(self._label, cause, f"{self.stream} {eid!r}: {reason}")
                # An oversized payload is not copied: the dead letters would hold it as long.
                kept = b"" if cause == INVALID else payload
                await self.dead_letter(eid, kept, reason, n, tag)
                continue
            if n > self.max_deliveries:
                await self.dead_letter(
                    eid,
                    payload,
                    f"redelivered: handed out {n} times without an ack (max_deliveries={self.max_deliveries})",
                    n,
                    tag,
                )
                continue
            try:
                message = self.message_type.FromString(payload)
            except DecodeError as e:
                UNTRUSTED.count(self._label, UNDECODABLE, f"{self.stream} {eid!r}: {e}")
                await self.dead_letter(
                    eid, payload, f"undecodable: not a {self.message_type.__name__}: {e}", n, tag
                )
                continue
            out.append(Delivery(entry_id=eid, message=message, deliveries=n))
        if out and self.metrics:
            self.metrics.delivered.labels(self._label, how).inc(len(out))
        return out

    def _untrusted(self, payload: bytes, tag: bytes | None) -> tuple[str, str] | None:
        """(cause, dead-letter reason) when the entry must not be decoded: too large, or not
        vouched for by the signer; None when it may."""
        if len(payload) > self.max_payload_bytes:
            return INVALID, f"oversized: {len(payload)} bytes, more than {self.max_payload_bytes}"
        if self.signer is None:
            return None
        cause = self.signer.check(self.stream, payload, tag)
        if cause == UNSIGNED:
            return cause, f"{UNSIGNED}: no tag, and this run signs its entries"
        if cause is not None:
            return cause, f"{cause}: the tag was not made with this run's key"
        return None


def _entries(reply: object) -> list[tuple[bytes, dict | None]]:
    """The (id, fields) pairs of a one-stream XREADGROUP reply as redis-py parses it."""
    if not reply:
        return []
    [[_stream, entries]] = reply  # one [stream, [(id, fields), ...]] per stream asked
    return [(eid, fields) for eid, fields in entries]
