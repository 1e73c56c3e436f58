"""The end-to-end learner tests' stack: a warmed-up tiny model with its data, and the real services
around a learner (Redis, reward, reference, one rollout replica)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import torch

from rlmesh.data import generate_arithmetic
from rlmesh.job.stack import free_port_overrides, start_stack
from rlmesh.learner.sft import arithmetic_examples, run_sft
from rlmesh.models import build_tiny_model, build_tokenizer, load_tokenizer
from rlmesh.runtime.launcher import ProcessLauncher, ServiceInstance
from rlmesh.v1 import common_pb2, rollout_pb2_grpc
from tests.support.repo import CPU_DEMO


@dataclass
class Prepared:
    model: Path
    data: dict[str, Path]


def prepare_model_and_data(root: Path) -> Prepared:
    """A 2-layer Qwen2 (hidden 64) after one epoch of supervised warm-up on 200 arithmetic
    problems (so rewards are not all zero), and the problems in verl's Parquet layout."""
    base = build_tiny_model(root / "base", build_tokenizer(), hidden_size=64, num_layers=2, seed=0)
    data = generate_arithmetic(
        root / "data", 0, train_size=200, val_size=16, min_terms=2, max_terms=2, max_operand=20, ops="+-"
    )
    examples, _ = arithmetic_examples(str(data["train"]), load_tokenizer(base))
    run_sft(
        str(base),
        str(root / "sft"),
        examples,
        epochs=1,
        lr=1e-3,
        batch_size=32,
        seed=0,
        log_fn=lambda m: None,
    )
    return Prepared(model=root / "sft", data=data)


@dataclass
class Peers:
    """The services a learner talks to, and the overrides that point a learner at them."""

    run_id: str
    redis_url: str
    common: list[str]  # run id, Redis, model, data, batch shape: shared by every service
    addresses: list[str]  # where the learner finds reward and reference
    rollout: ServiceInstance

    @property
    def learner_overrides(self) -> list[str]:
        return [*self.common, *self.addresses, *free_port_overrides("learner")]


def run_overrides(
    run_id: str, redis_url: str | None, prepared: Prepared, run_dir: Path, extra: list[str]
) -> list[str]:
    """What every service of one small run is given: run id, Redis (None: the stack starts one),
    model, data, batch shape."""
    return [
        f"rlmesh.run_id={run_id}",
        *([f"rlmesh.redis_url={redis_url}"] if redis_url else []),
        f"actor_rollout_ref.model.path={prepared.model}",
        f"data.train_files={prepared.data['train']}",
        f"data.val_files={prepared.data['test']}",
        f"trainer.default_local_dir={run_dir}",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=8",
        *extra,
    ]


def start_peers(launcher: ProcessLauncher, prepared: Prepared, run_dir: Path, extra: list[str]) -> Peers:
    """Redis, reward, reference and one rollout replica (embedded engine) for a new run id."""
    run_id = f"e2e-{uuid.uuid4().hex[:6]}"
    common = [*run_overrides(run_id, None, prepared, run_dir, extra), "rlmesh.rollout.replicas=1"]
    stack = start_stack(
        launcher, str(CPU_DEMO), common, services=("reward", "reference", "rollout"), say=lambda m: None
    )
    addresses = [o for o in stack.overrides if o.startswith(("rlmesh.reward.", "rlmesh.reference."))]
    return Peers(
        run_id=run_id,
        redis_url=stack.redis_url,
        common=[*common, f"rlmesh.redis_url={stack.redis_url}"],
        addresses=addresses,
        rollout=stack.rollouts[0],
    )


def engine_url(rollout_address: str) -> str:
    with grpc.insecure_channel(rollout_address) as channel:
        return rollout_pb2_grpc.RolloutStub(channel).GetInfo(common_pb2.Empty(), timeout=10).engine_url


def engine_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The named parameters as the engine holds them now (whole tensors: truncate_size 0)."""
    out = {}
    for name in names:
        resp = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 0}, timeout=60)
        resp.raise_for_status()
        out[name] = torch.tensor(resp.json())
    return out
