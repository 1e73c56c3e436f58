"""The actors ``rlmesh ray up`` asks Ray for: which services, with what resources and restarts,
from the config and the flags; bad flags and actors no node can hold are refused with a message
naming them; which exits of a service end its actor for Ray to restart it."""

from __future__ import annotations

import pytest

from rlmesh.config import load_config
from rlmesh.ray.plan import PlanError, parse_service_values, plan_actors, unplaceable
from rlmesh.ray.shell import ends_actor
from rlmesh.ray.up import restart_rule
from rlmesh.runtime.launcher import EXIT_RESTART
from tests.support.repo import CPU_DEMO


def test_the_cpu_demo_plans_redis_reward_two_replicas_and_a_learner_without_gpus():
    plans = plan_actors(load_config(str(CPU_DEMO)), max_restarts=2)
    assert [p.name for p in plans] == ["redis", "reward", "rollout-0", "rollout-1", "learner", "control"]
    assert all(p.num_gpus == 0 for p in plans)
    assert [p.max_restarts for p in plans] == [0, 0, 2, 2, 2, 0]
    assert plans[-1].demand() == {}  # the control plane takes no CPU from the services'
    off = plan_actors(load_config(str(CPU_DEMO), ["rlmesh.control.enabled=false"]))
    assert "control" not in [p.name for p in off]
    assert plans[2].extra_overrides == ("rlmesh.sampler.replica_id=rollout-0",)


def test_gpus_come_from_the_config_on_cuda():
    cfg = load_config(
        str(CPU_DEMO),
        [
            "trainer.device=cuda",
            "rlmesh.learner.ranks=4",
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "rlmesh.reference.colocated=false",
            "rlmesh.placement.reference_gpus=1",
        ],
    )
    gpus = {p.name: p.num_gpus for p in plan_actors(cfg)}
    assert gpus == {
        "redis": 0,
        "reward": 0,
        "reference": 1,
        "rollout-0": 2,
        "rollout-1": 2,
        "learner": 4,
        "control": 0,
    }


def test_a_reference_sharing_the_learners_gpu_is_refused_under_ray():
    cfg = load_config(
        str(CPU_DEMO),
        ["trainer.device=cuda", "rlmesh.reference.colocated=false", "rlmesh.reference.device=cuda"],
    )
    with pytest.raises(PlanError, match=r"reference_gpus=0 has it share the learner's first GPU, which Ray"):
        plan_actors(cfg)
    assert {p.name: p.num_gpus for p in plan_actors(cfg, num_gpus={"reference": 0.5})}["reference"] == 0.5


def test_given_services_are_not_started_and_flags_override_the_defaults():
    cfg = load_config(str(CPU_DEMO), ["rlmesh.reward.addresses=['10.0.0.1:5']", "rlmesh.rollout.replicas=1"])
    plans = plan_actors(
        cfg,
        given=["rlmesh.redis_url"],
        num_cpus={"learner": 4.0},
        resources=parse_service_values(['rollout={"node2": 1}'], "--resources", "json"),
    )
    assert [p.name for p in plans] == ["rollout-0", "learner", "control"]
    assert plans[0].demand() == {"CPU": 1.0, "node2": 1.0}
    assert plans[1].demand() == {"CPU": 4.0}


@pytest.mark.parametrize(
    ("item", "kind", "message"),
    [
        ("rollout", "number", "expected SERVICE=VALUE"),
        ("critic=1", "number", "expected SERVICE=VALUE"),
        ("rollout=two", "number", "is not a number"),
        ("rollout=-1", "number", "must be >= 0"),
        ("rollout={bad", "json", "is not JSON"),
        ('rollout=["a"]', "json", "JSON object"),
        ('rollout={"GPU": 1}', "json", "--num-cpus and --num-gpus"),
    ],
)
def test_bad_flags_are_refused_naming_them(item, kind, message):
    with pytest.raises(PlanError, match=message):
        parse_service_values([item], "--flag", kind)


def test_an_actor_no_node_can_hold_is_named():
    plans = plan_actors(
        load_config(str(CPU_DEMO), ["rlmesh.rollout.replicas=1"]), resources={"rollout": {"node2": 1}}
    )
    nodes = [{"CPU": 2.0, "head": 1.0}]
    assert unplaceable(plans, nodes) == [
        "rollout-0 asks for CPU=1, node2=1: no node of the cluster has that much"
    ]
    assert unplaceable(plans, [*nodes, {"CPU": 1.0, "node2": 1.0}]) == []


def test_the_learner_restarts_only_when_it_died_a_replica_on_any_exit():
    plans = plan_actors(load_config(str(CPU_DEMO)), max_restarts=2)
    rules = {p.name: restart_rule(p) for p in plans}
    assert rules == {
        "redis": "",
        "reward": "",
        "rollout-0": "exit",
        "rollout-1": "exit",
        "learner": "death",
        "control": "",
    }
    # Killed (by a signal, as Popen or a shell reports it) or a rank lost: Ray restarts it.
    assert [ends_actor("death", code) for code in (-9, -15, 128 + 9, EXIT_RESTART)] == [True] * 4
    # Its run over (0), an error of its own (1) or its config (2): the run ends with that code.
    assert [ends_actor("death", code) for code in (0, 1, 2)] == [False] * 3
    assert [ends_actor("exit", code) for code in (0, 1, 3, -9)] == [True] * 4  # a replica: any exit
    assert [ends_actor("", code) for code in (0, 1, -9)] == [False] * 3
    never = plan_actors(load_config(str(CPU_DEMO)), max_restarts=0)
    assert {p.max_restarts for p in never} == {0}
    assert {restart_rule(p) for p in never} == {""}
