"""The control plane's tests' stack: a private Redis, a real learner service on a tiny model that
waits for replicas (none come, so it serves its control RPCs at step 0 for as long as a test
needs) and a real ``rlmesh serve control`` in front of it, every one a process; and the HTTP
client a test calls it with."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from rlmesh.data import generate_arithmetic
from rlmesh.job.stack import free_port_overrides
from rlmesh.runtime.launcher import ProcessLauncher, ServiceInstance
from tests.support.learner import tiny_model
from tests.support.repo import CPU_DEMO

TOKEN = "control-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Nothing listens on port 1: the configured reward service a test never starts.
NO_REWARD = "127.0.0.1:1"


@dataclass
class ControlStack:
    url: str
    run_id: str
    redis_url: str
    overrides: list[str]  # what the learner and the control plane were given (the token included)
    learner: ServiceInstance
    control: ServiceInstance

    def client(self, user: str = "tester") -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={**AUTH, "X-Rlmesh-User": user}, timeout=60)


def start_control_stack(
    launcher: ProcessLauncher, root: Path, control_extra: list[str] | None = None
) -> ControlStack:
    model = tiny_model(root / "model")
    data = generate_arithmetic(
        root / "data", 0, train_size=64, val_size=4, min_terms=2, max_terms=2, max_operand=9, ops="+"
    )
    redis = launcher.start_redis(password="control-test-redis-pw")
    run_id = f"control-{uuid.uuid4().hex[:8]}"
    common = [
        f"rlmesh.run_id={run_id}",
        f"rlmesh.redis_url={redis.url}",
        f"rlmesh.auth_token={TOKEN}",  # the launcher hands it over in the environment, not argv
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data['train']}",
        f"data.val_files={data['test']}",
        f"trainer.default_local_dir={root / 'run'}",
        "algorithm.adv_estimator=grpo",
        f"rlmesh.reward.addresses=['{NO_REWARD}']",
        # A test registers a stand-in replica for a moment: a learner that saw it would validate
        # through it and fail; without validation it only queues step 1's prompts and waits.
        "trainer.val_before_train=false",
    ]
    learner = launcher.start_service(
        "learner", config_path=CPU_DEMO, overrides=[*common, *free_port_overrides("learner")], timeout_s=300
    )
    overrides = [*common, f"rlmesh.learner.addresses=['{learner.grpc_address}']"]
    control = launcher.start_service(
        "control",
        config_path=CPU_DEMO,
        overrides=[*overrides, *free_port_overrides("control"), *(control_extra or [])],
        timeout_s=60,
    )
    return ControlStack(
        url=f"http://{control.grpc_address}",
        run_id=run_id,
        redis_url=redis.url,
        overrides=overrides,
        learner=learner,
        control=control,
    )
