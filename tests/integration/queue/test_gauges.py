"""The run's queue and registry gauges read from a real redis-server: what they report is what the
streams and the registry hold."""

from prometheus_client import CollectorRegistry

from rlmesh.queue import ReplicaRegistry, RunKeys, prompt_queue, trajectory_queue
from rlmesh.queue.gauges import RunQueueGauges, WatchedStream, keys_of_stream
from rlmesh.v1 import trajectory_pb2
from tests.support.polling import eventually


def tasks(n):
    return [trajectory_pb2.PromptTask(uid=f"t{i}", group_uid=f"g{i}", n=1, prompt_ids=[i]) for i in range(n)]


def sample(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_the_run_is_found_from_its_streams_names():
    keys = RunKeys("run-1:a.b")
    assert keys_of_stream(keys.prompts) == keys
    assert keys_of_stream(keys.trajectories) == keys
    assert keys_of_stream(keys.dead_letters) is None  # only the two work streams name a run here
    assert keys_of_stream("prompts") is None
    assert keys_of_stream("rlmesh:{bad id!}:prompts") is None


async def test_gauges_report_lengths_work_dead_letters_and_live_replicas(redis, keys):
    replica = prompt_queue(redis, keys, "replica-1")
    published = trajectory_queue(redis, keys, "replica-1")
    registry = CollectorRegistry()
    gauges = RunQueueGauges(
        redis, keys, [WatchedStream(q.stream, q.group) for q in (replica, published)], registry
    )
    # Before anything exists every series is there, at 0 (no group yet: nothing in work).
    await gauges.refresh()
    for stream in ("prompts", "trajectories", "dead"):
        assert sample(registry, "rlmesh_queue_length", stream=stream) == 0
    assert sample(registry, "rlmesh_queue_pending", stream="trajectories") == 0
    assert sample(registry, "rlmesh_replicas_registered") == 0

    await replica.ensure_group()
    await prompt_queue(redis, keys, "learner").put(tasks(5))
    claimed = await replica.claim(3)
    await replica.dead_letter(claimed[0].entry_id, claimed[0].message.SerializeToString(), "failed: test", 1)
    await published.put([trajectory_pb2.Trajectory(uid="g0/0", group_uid="g0")])
    registry_of_run = ReplicaRegistry(redis, keys, ttl_s=30)
    for name in ("replica-1", "replica-2"):
        await registry_of_run.register(trajectory_pb2.ReplicaRegistration(replica_id=name))
    await ReplicaRegistry(redis, keys, ttl_s=0.05).register(
        trajectory_pb2.ReplicaRegistration(replica_id="gone")
    )

    await gauges.refresh()
    assert sample(registry, "rlmesh_queue_length", stream="prompts") == 4  # one dead-lettered
    assert sample(registry, "rlmesh_queue_pending", stream="prompts") == 2  # claimed, not acked
    assert sample(registry, "rlmesh_queue_length", stream="trajectories") == 1
    # The learner has not made its group on the trajectory stream: nothing is in work there.
    assert sample(registry, "rlmesh_queue_pending", stream="trajectories") == 0
    assert sample(registry, "rlmesh_queue_length", stream="dead") == 1

    async def live():
        await gauges.refresh()
        return sample(registry, "rlmesh_replicas_registered")

    await eventually(live, 2, "the expired registration to drop out")
