"""The share of the autoscaler's target a job's own actuator runs: the target less the live
replicas that were never the job's."""

from rlmesh.job.local_fleet import local_goal
from rlmesh.queue.fleet_target import FleetTarget


def test_replicas_started_elsewhere_count_toward_the_target():
    target = FleetTarget(desired=5, live=["rollout-0", "rollout-1", "host-b-77", "host-c-12"])
    assert local_goal(target, {"rollout-0", "rollout-1"}) == 3


def test_one_of_ours_the_target_still_lists_after_its_stop_is_not_someone_elses():
    # rollout-2 stopped a moment ago: the target, a poll old, still counts it live.
    target = FleetTarget(desired=2, live=["rollout-0", "rollout-1", "rollout-2"])
    assert local_goal(target, {"rollout-0", "rollout-1", "rollout-2"}) == 2


def test_never_below_zero():
    target = FleetTarget(desired=1, live=["a", "b", "c"])
    assert local_goal(target, {"rollout-0"}) == 0
