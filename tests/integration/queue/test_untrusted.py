"""What is read from a real Redis is not trusted as it is: registry entries, stream entries and the
policy record that are not protobufs, unsigned, signed with another key, oversized or name no
service are skipped (streams: dead-lettered with the reason) and counted; the rest still goes on."""

from rlmesh.control.fleet import replay_dead_letter
from rlmesh.queue import ReplicaRegistry, RunKeys, trajectory_queue
from rlmesh.queue.gauges import RunQueueGauges
from rlmesh.queue.policy import PolicyState, publish_policy, read_policy
from rlmesh.queue.signing import (
    BAD_SIGNATURE,
    INVALID,
    SIGNED_PREFIX,
    UNDECODABLE,
    UNSIGNED,
    UNTRUSTED,
    signer_for,
)
from rlmesh.queue.streams import PAYLOAD, StreamQueue
from rlmesh.v1 import trajectory_pb2

TOKEN = "queue-test-token-7c2"


def registration(replica_id, grpc="127.0.0.1:50070", engine="http://127.0.0.1:30070"):
    return trajectory_pb2.ReplicaRegistration(
        replica_id=replica_id, grpc_address=grpc, engine_url=engine, engine="embedded", state="serving"
    )


def forged(keys):
    """The run's keys as someone without its token would sign with."""
    return RunKeys(keys.run_id, signer_for("not-the-token", keys.run_id))


def trajectory(uid, score=1.0):
    return trajectory_pb2.Trajectory(
        uid=uid, group_uid=uid.split("/")[0], prompt_ids=[1], response_ids=[2], score=score
    )


async def test_a_registry_value_that_is_no_protobuf_is_skipped_not_raised(redis, keys):
    registry = ReplicaRegistry(redis, keys, ttl_s=60)
    await registry.register(registration("good"))
    await redis.set(keys.replica("junk"), b"\xff\xfe not a protobuf")
    await redis.sadd(keys.replicas, "junk", b"\xff\xfe")  # and an id that is not even text
    before = UNTRUSTED.total("registry")
    assert [r.replica_id for r in await registry.live()] == ["good"]
    assert UNTRUSTED.total("registry", UNDECODABLE) >= 1 and UNTRUSTED.total("registry") == before + 2
    assert b"\xff\xfe" not in await redis.smembers(keys.replicas)  # no replica could remove it
    gauges = RunQueueGauges(redis, keys, [], registry=None)
    await redis.sadd(keys.replicas, b"\xff\xfe")
    await gauges.refresh()  # the gauges read the index too
    assert gauges.replicas._value.get() == 2


async def test_with_a_token_only_the_runs_signed_registrations_with_service_addresses_are_live(redis, keys):
    signed = RunKeys.signed(keys.run_id, TOKEN)
    registry = ReplicaRegistry(redis, signed, ttl_s=60)
    await registry.register(registration("replica-a"))
    raw = await redis.get(keys.replica("replica-a"))
    assert raw.startswith(SIGNED_PREFIX) and TOKEN.encode() not in raw
    # Whoever can write to Redis but holds no token: a forged signature, none at all, a copy of a
    # good entry under another id; and a signed entry that names no service.
    await ReplicaRegistry(redis, forged(keys), ttl_s=60).register(registration("evil", grpc="10.6.6.6:50051"))
    await ReplicaRegistry(redis, keys, ttl_s=60).register(registration("bare"))
    await redis.set(keys.replica("copy"), raw)
    await redis.sadd(keys.replicas, "copy")
    await registry.register(registration("metadata", engine="http://169.254.169.254:80"))
    await registry.register(registration("no-port", grpc="127.0.0.1"))
    counts = {c: UNTRUSTED.total("registry", c) for c in (BAD_SIGNATURE, UNSIGNED, INVALID)}
    assert [r.replica_id for r in await registry.live()] == ["replica-a"]
    assert UNTRUSTED.total("registry", BAD_SIGNATURE) == counts[BAD_SIGNATURE] + 2  # evil, copy
    assert UNTRUSTED.total("registry", UNSIGNED) == counts[UNSIGNED] + 1
    assert UNTRUSTED.total("registry", INVALID) == counts[INVALID] + 2
    # A process without the token (a loopback-only tool) reads the signed entries as they are.
    unsigned_view = await ReplicaRegistry(redis, keys).live()
    assert "replica-a" in {r.replica_id for r in unsigned_view}


async def test_forged_and_unsigned_stream_entries_are_dead_lettered_and_the_rest_delivered(redis, keys):
    signed = RunKeys.signed(keys.run_id, TOKEN)
    producer = trajectory_queue(redis, signed, "replica")
    learner = trajectory_queue(redis, signed, "learner-0")
    await learner.ensure_group()
    await producer.put([trajectory("g/0")])
    await trajectory_queue(redis, forged(keys), "attacker").put([trajectory("g/1", score=1e3)])
    await trajectory_queue(redis, keys, "attacker").put([trajectory("g/2", score=1e3)])
    await redis.xadd(keys.trajectories, {PAYLOAD: trajectory("g/3").SerializeToString(), b"s": b"v1:00"})
    await producer.put([trajectory("g/4")])
    before = UNTRUSTED.total("trajectories")
    got = await learner.claim(10)
    assert [d.message.uid for d in got] == ["g/0", "g/4"]
    await learner.ack([d.entry_id for d in got])
    assert UNTRUSTED.total("trajectories") == before + 3
    dead = await learner.dead_letters()
    assert sorted(d.reason.split(":")[0] for d in dead) == [BAD_SIGNATURE, BAD_SIGNATURE, UNSIGNED]
    assert {d.message.uid for d in dead} == {"g/1", "g/2", "g/3"}
    assert await learner.length() == 0 and await learner.pending() == 0

    # A replayed forgery keeps its own tag: refused again, never laundered by the replay.
    [forgery] = [d for d in await redis.xrevrange(keys.dead_letters) if b"g/1" in d[1][PAYLOAD]]
    await replay_dead_letter(redis, signed, forgery[0].decode())
    assert await learner.claim(10) == []
    assert len(await learner.dead_letters()) == 3


async def test_a_good_entry_dead_lettered_for_another_reason_replays_with_its_tag(redis, keys):
    signed = RunKeys.signed(keys.run_id, TOKEN)
    await trajectory_queue(redis, signed, "replica").put([trajectory("r/0")])
    impatient = trajectory_queue(redis, signed, "learner-0", max_deliveries=0)
    await impatient.ensure_group()
    assert await impatient.claim(5) == []  # handed out once, more than max_deliveries: dead
    [dead] = await redis.xrevrange(keys.dead_letters)
    assert dead[1][b"reason"].startswith(b"redelivered") and dead[1][b"s"].startswith(b"v1:")
    await replay_dead_letter(redis, signed, dead[0].decode())
    learner = trajectory_queue(redis, signed, "learner-1")
    [again] = await learner.claim(5)
    assert again.message.uid == "r/0"
    # Its consumer gives up on it (a sample it refuses): dead-lettered with a tag of what it read.
    await learner.dead_letter_message(again.entry_id, again.message, "invalid: test", again.deliveries)
    [dead] = await redis.xrevrange(keys.dead_letters, count=1)
    await replay_dead_letter(redis, signed, dead[0].decode())
    [third] = await learner.claim(5)
    assert third.message.uid == "r/0"
    await learner.ack([third.entry_id])


async def test_an_oversized_entry_is_dead_lettered_undecoded_without_its_payload(redis, keys):
    producer = trajectory_queue(redis, keys, "replica")
    small = StreamQueue(
        redis,
        keys.trajectories,
        "learner",
        "learner-0",
        trajectory_pb2.Trajectory,
        maxlen=100,
        dead_letter_stream=keys.dead_letters,
        max_payload_bytes=200,
    )
    await small.ensure_group()
    big = trajectory("big/0")
    big.response_text = "x" * 500
    await producer.put([big, trajectory("ok/0")])
    assert [d.message.uid for d in await small.claim(5)] == ["ok/0"]
    [(_, fields)] = await redis.xrevrange(keys.dead_letters)
    assert fields[b"reason"].startswith(b"oversized: ") and fields[PAYLOAD] == b""


async def test_the_policy_record_is_read_only_when_the_run_signed_it(redis, keys):
    signed = RunKeys.signed(keys.run_id, TOKEN)
    await publish_policy(redis, signed, 4, "/ckpt/weights/v4")
    assert (await read_policy(redis, signed)).disk_path == "/ckpt/weights/v4"
    assert (await read_policy(redis, keys)).version == 4  # without a key: read as it is
    await publish_policy(redis, signed, 5)  # no snapshot this time: the old path must not stay
    assert await read_policy(redis, signed) == PolicyState(5, None)

    before = UNTRUSTED.total("policy")
    await publish_policy(redis, keys, 99, "/etc")  # unsigned, as anyone with Redis could
    assert (await read_policy(redis, signed)).version == 0
    await publish_policy(redis, forged(keys), 99, "/etc")
    state = await read_policy(redis, signed)
    assert (state.version, state.disk_path) == (0, None)
    # A record changed after it was signed.
    await publish_policy(redis, signed, 6, "/ckpt/weights/v6")
    await redis.hset(keys.scoped("policy"), "disk_path", "/etc")
    assert (await read_policy(redis, signed)).disk_path is None
    assert UNTRUSTED.total("policy", UNSIGNED) >= 1 and UNTRUSTED.total("policy") == before + 3
    # Not a number: version 0, never an exception in the replica that reads it.
    await redis.hset(keys.scoped("policy"), "version", "lots")
    assert (await read_policy(redis, keys)).version == 0
