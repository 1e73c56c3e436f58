"""The GPU plan: verl's trainer.n_gpus_per_node split between the learner's ranks, the SGLang
replicas and the reference, each process's devices, and the refusals naming the numbers."""

import pytest

from rlmesh.config import ConfigError, load_config
from rlmesh.config.placement import (
    Placed,
    PlacementError,
    check_fits_machine,
    plan_gpus,
    split_gpus,
)


def plan_for(gpus: int, tp: int, *extra: str):
    cfg = load_config(
        overrides=[
            f"trainer.n_gpus_per_node={gpus}",
            "actor_rollout_ref.rollout.name=sglang",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
            *extra,
        ],
        warn=False,
    )
    return cfg, plan_gpus(cfg)


@pytest.mark.parametrize(
    ("gpus", "tp", "placed"),
    [
        (1, 1, {"learner": (0,), "rollout-0": (0,), "reference": (0,)}),
        (2, 1, {"learner": (0,), "rollout-0": (1,), "reference": (0,)}),
        (2, 2, {"learner": (0, 1), "rollout-0": (0, 1), "reference": (0,)}),  # verl's run_gemma.sh
        (4, 1, {"learner": (0, 1), "rollout-0": (2,), "rollout-1": (3,), "reference": (0,)}),
        (4, 2, {"learner": (0, 1), "rollout-0": (2, 3), "reference": (0,)}),
        (
            8,
            1,
            {
                "learner": (0, 1, 2, 3),
                **{f"rollout-{i}": (4 + i,) for i in range(4)},
                "reference": (0,),
            },
        ),
        (8, 2, {"learner": (0, 1, 2, 3), "rollout-0": (4, 5), "rollout-1": (6, 7), "reference": (0,)}),
    ],
)
def test_every_gpu_of_the_node_goes_to_one_process_of_its_own(gpus, tp, placed):
    cfg, plan = plan_for(gpus, tp)
    assert {p.name: p.gpus for p in plan.placed} == placed
    assert cfg.rlmesh.learner.ranks == len(placed["learner"])
    assert cfg.rlmesh.rollout.replicas == sum(name.startswith("rollout") for name in placed)
    # No GPU holds two ranks of one weight group unless the plan says they share it (gloo then).
    learner = set(placed["learner"])
    assert plan.shared == any(learner & set(g) for n, g in placed.items() if n.startswith("rollout"))
    assert cfg.rlmesh.weight_sync.backend == ("gloo" if plan.shared else "auto")


def test_a_replica_wider_than_the_node_is_refused_with_the_numbers():
    with pytest.raises(ConfigError) as refused:
        plan_for(1, 2)
    assert (
        "a rollout replica of tensor_model_parallel_size=2 needs 2 GPUs; trainer.n_gpus_per_node=1 has 1"
        in str(refused.value)
    )


def test_ranks_and_replicas_the_config_sets_must_fit_and_are_refused_with_the_numbers():
    with pytest.raises(ConfigError) as refused:
        plan_for(4, 2, "rlmesh.learner.ranks=2", "rlmesh.rollout.replicas=2")
    message = str(refused.value)
    assert "trainer.n_gpus_per_node=4 does not fit 2 learner rank(s) + 2 rollout replica(s) x " in message
    assert "tensor_model_parallel_size=2 = 6 GPUs" in message and "ranks + replicas x tp <= 4" in message


def test_ranks_and_replicas_the_config_sets_are_kept_and_checked():
    _, plan = plan_for(8, 2, "rlmesh.learner.ranks=2", "rlmesh.rollout.replicas=3")
    assert {p.name: p.gpus for p in plan.placed}["rollout-2"] == (6, 7)
    cfg, plan = plan_for(8, 1, "rlmesh.learner.ranks=6")
    assert cfg.rlmesh.rollout.replicas == 2  # what the ranks leave
    cfg, plan = plan_for(8, 2, "rlmesh.rollout.replicas=1")
    assert cfg.rlmesh.learner.ranks == 6
    with pytest.raises(ConfigError, match=r"does not fit 4 learner rank\(s\) \+ 3 rollout replica\(s\) x "):
        plan_for(8, 2, "rlmesh.learner.ranks=4", "rlmesh.rollout.replicas=3")


def test_a_reference_with_a_gpu_of_its_own_takes_the_next_one():
    _, plan = plan_for(4, 1, "rlmesh.placement.reference_gpus=1")
    assert {p.name: p.gpus for p in plan.placed} == {
        "learner": (0,),
        "rollout-0": (1,),
        "rollout-1": (2,),
        "reference": (3,),
    }


def test_a_colocated_reference_or_a_cpu_learner_takes_no_gpu():
    _, plan = plan_for(2, 1, "rlmesh.reference.colocated=true")
    assert [p.name for p in plan.placed] == ["learner", "rollout-0"]
    _, plan = plan_for(4, 2, "trainer.device=cpu", "rlmesh.reference.device=cpu")
    assert {p.name: p.gpus for p in plan.placed} == {"rollout-0": (0, 1), "rollout-1": (2, 3)}


def test_the_cpu_engine_leaves_every_gpu_to_the_learner_and_a_cpu_job_has_no_plan():
    cfg = load_config(
        overrides=["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.name=embedded"], warn=False
    )
    assert cfg.rlmesh.learner.ranks == 4
    cpu = load_config(
        overrides=[
            "trainer.device=cpu",
            "actor_rollout_ref.rollout.name=embedded",
            "rlmesh.reference.device=cpu",
        ],
        warn=False,
    )
    assert plan_gpus(cpu) is None


def test_nccl_on_a_shared_gpu_is_refused():
    with pytest.raises(ConfigError, match="NCCL refuses two ranks of one group on one GPU"):
        plan_for(1, 1, "rlmesh.weight_sync.backend=nccl")


def test_each_process_sees_only_its_gpus_through_the_launchers_own():
    placed = Placed("rollout-1", (2, 3))
    assert placed.env() == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert placed.env(["4", "5", "6", "GPU-abc"]) == {"CUDA_VISIBLE_DEVICES": "6,GPU-abc"}


def test_a_plan_larger_than_the_machine_is_refused_naming_both():
    _, plan = plan_for(8, 2)
    with pytest.raises(PlacementError, match="uses 8 GPUs but this machine has 2") as refused:
        check_fits_machine(plan, 2)
    assert "rollout-1    GPU 6,7" in str(refused.value)
    check_fits_machine(plan, 8)


def test_split_without_gpu_replicas_gives_the_learner_every_gpu():
    assert (
        split_gpus(8, tp=2, learner_on_gpu=True, rollout_on_gpu=False, ranks=None, replicas=None).ranks == 8
    )
