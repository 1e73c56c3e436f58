"""What ``start_stack`` starts for a config, and in what order ``Stack.stop`` stops it, with
launchers that record instead of starting and stopping."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlmesh.job.stack import Stack, start_stack
from rlmesh.runtime.launcher import ServiceInstance

REDIS = "rlmesh.redis_url=redis://127.0.0.1:1/0"  # given: no Redis is started


class RecordingLauncher:
    """Spawns nothing: each service "serves" when its turn in ``ready_order`` comes (by default in
    the order they were asked for), and ``then`` is told, as the real launcher tells it."""

    def __init__(self, ready_order: list[str] | None = None) -> None:
        self.started: list[tuple[str, str, list[str]]] = []
        self.envs: dict[str, dict[str, str] | None] = {}
        self.waves: list[list[str]] = []  # names started together: at first, then each time one served
        self.ready_order = ready_order
        self.events: list[str] = []  # "start <name>" and "ready <name>", in order

    def start_services(self, requests, then=None):
        instances, pending = [], []

        def start(batch):
            if batch:
                self.waves.append([r.name for r in batch])
            for r in batch:
                self.started.append((r.service, r.name, list(r.overrides)))
                self.envs[r.name] = r.env
                self.events.append(f"start {r.name}")
                process = SimpleNamespace(pid=1000 + len(self.started))
                instance = ServiceInstance(process, r.name, f"127.0.0.1:{6000 + len(self.started)}", None)
                instances.append(instance)
                pending.append(instance)

        start(list(requests))
        while pending:
            order = self.ready_order or [i.name for i in pending]
            instance = min(pending, key=lambda i: order.index(i.name))
            pending.remove(instance)
            self.events.append(f"ready {instance.name}")
            if then is not None:
                start(list(then(instance)))
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


def port_given(overrides: list[str], service: str) -> str:
    """The gRPC port ``start_stack`` chose for ``service`` (its last ``rlmesh.<service>.port``)."""
    return [o for o in overrides if o.startswith(f"rlmesh.{service}.port=")][-1].split("=")[1]


def test_the_reference_service_is_the_default():
    launcher = RecordingLauncher()
    stack = start_stack(launcher, None, [REDIS, "algorithm.use_kl_in_reward=true"], say=lambda line: None)
    assert [name for _, name, _ in launcher.started] == [
        "reward",
        "reference",
        "rollout-0",
        "learner",
        "control",
    ]
    reference = next(o for _, name, o in launcher.started if name == "reference")
    port = port_given(reference, "reference")
    assert port != "0" and f"rlmesh.reference.addresses=['127.0.0.1:{port}']" in stack.overrides


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


def test_all_but_the_control_plane_start_at_once_told_the_reward_and_reference_ports():
    # The learner comes up long before the replicas, the reward after the learner.
    launcher = RecordingLauncher(
        ready_order=["reference", "learner", "control", "reward", "rollout-0", "rollout-1"]
    )
    stack = start_stack(
        launcher,
        None,
        [REDIS, "algorithm.use_kl_in_reward=true", "rlmesh.rollout.replicas=2"],
        say=lambda line: None,
    )
    # Nobody waits for the reward or reference to serve: their ports are chosen up front and given
    # to the replicas and the learner; the control plane needs the learner's address, not the replicas'.
    assert launcher.waves == [["reward", "reference", "rollout-0", "rollout-1", "learner"], ["control"]]
    assert launcher.events.index("start control") < launcher.events.index("ready reward")
    by_name = {name: overrides for _, name, overrides in launcher.started}
    ports = {service: port_given(by_name[service], service) for service in ("reward", "reference")}
    assert len(set(ports.values())) == 2 and "0" not in ports.values()
    for name in ("rollout-0", "rollout-1", "learner"):
        for service, port in ports.items():
            assert f"rlmesh.{service}.addresses=['127.0.0.1:{port}']" in by_name[name]
    # Reported in the order they were started, whatever order they came up in.
    assert [s.name for s in stack.started] == [
        "reward",
        "reference",
        "rollout-0",
        "rollout-1",
        "learner",
        "control",
    ]


def test_with_reward_and_reference_given_the_replicas_and_learner_start_at_once():
    launcher = RecordingLauncher()
    start_stack(
        launcher,
        None,
        [REDIS, "rlmesh.reward.addresses=[h:1]", "rlmesh.reference.colocated=true"],
        say=lambda line: None,
    )
    assert launcher.waves == [["rollout-0", "learner"], ["control"]]


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


class StoppingLauncher:
    """Records the groups ``Stack.stop`` stops together; nothing is signalled."""

    def __init__(self) -> None:
        self.groups: list[list[str]] = []
        self.meanwhile: list[list[str]] = []  # the groups ``meanwhile`` ran alongside

    def stop_together(self, procs, grace_s=None, meanwhile=None):
        self.groups.append([p.name for p in procs])
        if meanwhile is not None:
            self.meanwhile.append(self.groups[-1])
            meanwhile()
        for p in procs:
            p.running = False


def fake_stack(*names: str) -> tuple[Stack, StoppingLauncher]:
    launcher = StoppingLauncher()

    def process(name):
        proc = SimpleNamespace(name=name, running=True)
        proc.alive = lambda: proc.running
        proc.popen = SimpleNamespace(wait=lambda: 0)
        return proc

    redis = SimpleNamespace(process=process("redis"))
    started = [ServiceInstance(process(n), n, "127.0.0.1:1", None) for n in names]
    return Stack("redis://", redis, [], started=started, launcher=launcher), launcher


SERVICES = ("reward", "rollout-0", "rollout-1", "learner", "control")


def test_a_stop_lets_the_learner_end_its_step_with_the_others_up_then_stops_them_together():
    stack, launcher = fake_stack(*SERVICES)
    ran = []
    stack.stop(meanwhile=lambda: ran.append("meanwhile"))
    assert launcher.groups == [["learner", "control"], ["reward", "rollout-0", "rollout-1"], ["redis"]]
    assert launcher.meanwhile == [["reward", "rollout-0", "rollout-1"]] and ran == ["meanwhile"]


def test_a_learner_whose_run_is_over_is_not_signalled_and_the_others_stop_at_once():
    stack, launcher = fake_stack(*SERVICES)
    stack.stop(learner_exiting=True)
    # The learner is only waited for (the launcher finds it exited and cleans up after it).
    assert launcher.groups == [["reward", "rollout-0", "rollout-1", "control"], ["learner"], ["redis"]]


def test_a_stack_attached_to_redis_stops_only_what_it_started():
    stack, launcher = fake_stack("rollout-0", "learner")
    stack.redis = None
    stack.stop()
    assert launcher.groups == [["learner"], ["rollout-0"]]
