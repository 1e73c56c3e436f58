"""What ``start_stack`` starts for a config, with a launcher that records instead of starting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlmesh.job.stack import start_stack
from rlmesh.runtime.launcher import ServiceInstance

REDIS = "rlmesh.redis_url=redis://127.0.0.1:1/0"  # given: no Redis is started


class RecordingLauncher:
    def __init__(self) -> None:
        self.started: list[tuple[str, str, list[str]]] = []
        self.envs: dict[str, dict[str, str] | None] = {}
        self.waves: list[list[str]] = []  # names started side by side, wave by wave

    def start_services(self, requests):
        instances = []
        for r in requests:
            self.started.append((r.service, r.name, list(r.overrides)))
            self.envs[r.name] = r.env
            process = SimpleNamespace(pid=1000 + len(self.started))
            instances.append(ServiceInstance(process, r.name, f"127.0.0.1:{6000 + len(self.started)}", None))
        self.waves.append([r.name for r in requests])
        return instances


def stack_of(*overrides: str) -> tuple[list[str], list[str], list[str]]:
    """Names started, lines said, and the overrides every service was given."""
    launcher, said = RecordingLauncher(), []
    stack = start_stack(launcher, None, [REDIS, *overrides], say=said.append)
    return [name for _, name, _ in launcher.started], said, stack.overrides


@pytest.mark.parametrize(
    "kl", ["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=true"]
)
def test_a_colocated_reference_starts_no_reference_service(kl):
    names, said, overrides = stack_of(kl, "rlmesh.reference.colocated=true")
    assert names == ["reward", "rollout-0", "learner", "control"]
    assert any(line.startswith("reference") and "colocated in the learner" in line for line in said), said
    assert not any(o.startswith("rlmesh.reference.addresses") for o in overrides)
    # Given addresses change nothing: the learner computes the log-probs itself.
    names, _, overrides = stack_of(kl, "rlmesh.reference.colocated=true", "rlmesh.reference.addresses=[h:1]")
    assert names == ["reward", "rollout-0", "learner", "control"]


def test_the_reference_service_is_the_default():
    names, _, overrides = stack_of("algorithm.use_kl_in_reward=true")
    assert names == ["reward", "reference", "rollout-0", "learner", "control"]
    assert "rlmesh.reference.addresses=['127.0.0.1:6002']" in overrides


def control_overrides(*overrides: str) -> list[str] | None:
    launcher = RecordingLauncher()
    start_stack(launcher, None, [REDIS, *overrides], say=lambda line: None)
    return next((o for service, _, o in launcher.started if service == "control"), None)


def test_the_control_plane_starts_last_pointed_at_the_learner():
    given = control_overrides()
    assert given is not None
    assert "rlmesh.learner.addresses=['127.0.0.1:6004']" in given  # the learner, started fourth
    assert "rlmesh.control.port=0" in given  # a free port unless one was given
    assert control_overrides("rlmesh.control.enabled=false") is None
    given = control_overrides("rlmesh.control.port=8123")
    assert given[-1] == "rlmesh.control.port=8123"  # after the free-port override: it wins


def test_services_start_in_three_waves_each_side_by_side():
    launcher = RecordingLauncher()
    start_stack(
        launcher,
        None,
        [REDIS, "algorithm.use_kl_in_reward=true", "rlmesh.rollout.replicas=2"],
        say=lambda line: None,
    )
    # Replicas and learner need the reward's and reference's addresses; control needs the learner's.
    assert launcher.waves == [["reward", "reference"], ["rollout-0", "rollout-1", "learner"], ["control"]]
    by_name = {name: overrides for _, name, overrides in launcher.started}
    for name in ("rollout-0", "rollout-1", "learner"):
        assert "rlmesh.reward.addresses=['127.0.0.1:6001']" in by_name[name]
        assert "rlmesh.reference.addresses=['127.0.0.1:6002']" in by_name[name]


def test_on_a_gpu_machine_each_process_is_started_with_its_own_gpus(monkeypatch):
    """The machine's GPUs are what this test cannot have: their count is given, the rest is real."""
    import rlmesh.job.stack as stack_module

    monkeypatch.setattr(stack_module, "gpu_present", lambda: True)
    monkeypatch.setattr(stack_module, "gpu_count", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    launcher, said = RecordingLauncher(), []
    start_stack(
        launcher,
        None,
        [
            REDIS,
            "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "algorithm.use_kl_in_reward=true",
        ],
        say=said.append,
    )
    gpus = {name: (env or {}).get("CUDA_VISIBLE_DEVICES") for name, env in launcher.envs.items()}
    assert gpus == {
        "reward": None,
        "reference": "0",
        "rollout-0": "4,5",
        "rollout-1": "6,7",
        "learner": "0,1,2,3",
        "control": None,
    }
    assert said[0].startswith("GPU plan for trainer.n_gpus_per_node=8")


def test_a_plan_the_machine_cannot_hold_stops_the_start(monkeypatch):
    import rlmesh.job.stack as stack_module
    from rlmesh.runtime.launcher import LaunchError

    monkeypatch.setattr(stack_module, "gpu_present", lambda: True)
    monkeypatch.setattr(stack_module, "gpu_count", lambda: 1)
    launcher = RecordingLauncher()
    with pytest.raises(LaunchError, match="uses 4 GPUs but this machine has 1"):
        start_stack(
            launcher,
            None,
            [REDIS, "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.name=sglang"],
            say=lambda line: None,
        )
    assert launcher.started == []
