"""``rlmesh up``: a private Redis plus every service, each as its own OS process on loopback.

It starts them in dependency order, waits until each answers gRPC health SERVING, checks that
each serves Prometheus metrics and what its info RPC answers, prints what it found, and stops
everything (at once, or on Ctrl-C with ``--hold``).
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from rlmesh.runtime.health import grpc_health, redis_ping, scrape_metrics
from rlmesh.runtime.launcher import LaunchError, ProcessLauncher, ServiceInstance
from rlmesh.v1 import (
    common_pb2,
    learner_pb2_grpc,
    reference_pb2_grpc,
    reward_pb2_grpc,
    rollout_pb2_grpc,
)

# service -> (stub class, the RPC that describes it)
INFO_RPC = {
    "reward": (reward_pb2_grpc.RewardStub, "GetInfo"),
    "reference": (reference_pb2_grpc.ReferenceStub, "GetInfo"),
    "rollout": (rollout_pb2_grpc.RolloutStub, "GetInfo"),
    "learner": (learner_pb2_grpc.LearnerStub, "GetStatus"),
}


@dataclass
class ServiceReport:
    name: str
    pid: int
    address: str
    health: str
    metrics: str
    info: str


def probe_info(service: str, address: str, token: str | None) -> str:
    """What the service's info RPC answers: OK, or the status code it returned."""
    if service not in INFO_RPC:
        return "-"
    stub_cls, method = INFO_RPC[service]
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        try:
            getattr(stub_cls(channel), method)(common_pb2.Empty(), timeout=5, metadata=metadata)
        except grpc.RpcError as e:
            return f"{method}: {e.code().name}"
    return f"{method}: OK"


def probe(instance: ServiceInstance, token: str | None) -> ServiceReport:
    host = instance.grpc_address.rsplit(":", 1)[0]
    metrics = "-"
    if instance.metrics_port:
        text = scrape_metrics(host, instance.metrics_port)
        metrics = f":{instance.metrics_port}/metrics ({sum(1 for ln in text.splitlines() if ln.startswith('rlmesh_'))} rlmesh series)"
    return ServiceReport(
        name=instance.name,
        pid=instance.process.pid,
        address=instance.grpc_address,
        health=grpc_health(instance.grpc_address),
        metrics=metrics,
        info=probe_info(instance.name, instance.grpc_address, token),
    )


def run_stack(
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    services: str | Sequence[str] = ("reward", "reference", "rollout", "learner"),
    hold: bool = False,
    workdir: str | None = None,
) -> int:
    from rlmesh.config import ConfigError, load_config

    names = [s for s in (services.split(",") if isinstance(services, str) else services) if s]
    try:
        cfg = load_config(config_path, overrides)  # fail here, once, before starting anything
    except ConfigError as e:
        print(f"invalid configuration:\n{e}")
        return 2
    run_id = cfg.rlmesh.run_id or f"up-{uuid.uuid4().hex[:8]}"
    token = cfg.rlmesh.auth_token
    t0 = time.monotonic()
    # Logs and Redis data stay in runs/<run id> (git-ignored) so they can be read afterwards.
    workdir = workdir or str(Path("runs") / run_id)
    with ProcessLauncher(workdir, stop_grace_s=cfg.rlmesh.runtime.shutdown_grace_s) as launcher:
        print(f"[rlmesh up] run {run_id}: logs in {launcher.workdir / 'logs'}", flush=True)
        redis = launcher.start_redis()
        print(
            f"[rlmesh up] redis   pid {redis.process.pid:<7} {redis.url}  PING: "
            f"{'PONG' if redis_ping(redis.host, redis.port) else 'no answer'}",
            flush=True,
        )
        common = [*overrides, f"rlmesh.redis_url={redis.url}", f"rlmesh.run_id={run_id}"]
        model_path = Path(cfg.actor_rollout_ref.model.path).expanduser()
        if not model_path.exists():
            model_path = _tiny_model(launcher.workdir / "tiny-model")
            common.append(f"actor_rollout_ref.model.path={model_path}")
            print(
                f"[rlmesh up] no model at {cfg.actor_rollout_ref.model.path}: built a tiny random Qwen2 at "
                f"{model_path} for this check",
                flush=True,
            )
        train_files = (
            cfg.data.train_files if isinstance(cfg.data.train_files, list) else [cfg.data.train_files]
        )
        if not all(Path(f).expanduser().exists() for f in train_files):
            from rlmesh.data import generate_arithmetic

            data = generate_arithmetic(
                launcher.workdir / "data",
                0,
                train_size=64,
                val_size=16,
                min_terms=2,
                max_terms=2,
                max_operand=20,
                ops="+",
            )
            common += [f"data.train_files={data['train']}", f"data.val_files={data['test']}"]
            print(
                f"[rlmesh up] no data at {train_files[0]}: wrote a small arithmetic set in {data['train'].parent}",
                flush=True,
            )
        started: list[ServiceInstance] = []
        try:
            for name in names:
                # Ports 0: each service binds free ports and reports them in its ready file.
                instance = launcher.start_service(
                    name,
                    config_path=config_path,
                    overrides=[
                        *common,
                        *_peer_addresses(started),
                        f"rlmesh.{name}.port=0",
                        f"rlmesh.{name}.metrics_port=0",
                    ],
                    timeout_s=cfg.rlmesh.runtime.health_timeout_s,
                )
                started.append(instance)
                report = probe(instance, token)
                print(
                    f"[rlmesh up] {report.name:<9} pid {report.pid:<7} {report.address:<16} health: "
                    f"{report.health:<8} metrics: {report.metrics}  {report.info}",
                    flush=True,
                )
        except LaunchError as e:
            print(f"[rlmesh up] start-up failed: {e}", flush=True)
            return 1
        print(
            f"[rlmesh up] {len(started)} services and redis healthy after {time.monotonic() - t0:.1f} s",
            flush=True,
        )
        if hold:
            print("[rlmesh up] holding; Ctrl-C stops everything", flush=True)
            while True:
                signal.pause()
        print("[rlmesh up] stopping everything", flush=True)
    print("[rlmesh up] all processes stopped", flush=True)
    return 0


def _tiny_model(out: Path) -> Path:
    from rlmesh.models import build_tiny_model, build_tokenizer

    return build_tiny_model(out, build_tokenizer(), hidden_size=64, num_layers=2)


def _peer_addresses(started: Sequence[ServiceInstance]) -> list[str]:
    return [f"rlmesh.{s.name}.addresses=['{s.grpc_address}']" for s in started]
