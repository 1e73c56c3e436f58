"""``docker-compose up --scale rollout=3`` trains a whole job for real (``make compose-test``):
images built from deploy/, Redis with its AOF on a volume and a password, reward, reference, three
replicas, the learner, Prometheus finding the replicas by DNS, a token on every call. A fourth
replica added mid-run joins and takes work, a first one stopped mid-run is not missed, the learner
killed mid-run is restarted by its container's restart policy and resumes; the run ends, every live replica holds the last policy, every step trained exactly its planned prompts,
nothing is left pending or dead-lettered, and the exported actor is on the volume."""

from __future__ import annotations

import json
import re
import secrets
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import yaml

from rlmesh.config import load_config
from rlmesh.data import RLHFDataset
from rlmesh.data.cursor import PromptCursor
from rlmesh.models.tokenizer import load_tokenizer
from rlmesh.queue.keys import RunKeys
from rlmesh.runtime.auth import bearer_metadata
from rlmesh.v1 import common_pb2, rollout_pb2_grpc
from tests.support.docker import (
    BASE_IMAGE,
    Compose,
    container_ip,
    container_state,
    ensure_base_image,
    ensure_dockerd,
    fill_build_extra,
    image_size_mb,
    inspect,
    kill_service_process,
    run,
)
from tests.support.jobs import Planned, audit_groups, plan_of
from tests.support.monitoring import DIRECT
from tests.support.polling import wait_until
from tests.support.repo import CPU_DEMO, REPO

pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]

STEPS = 40
SCALE_UP_AT = 5  # the fourth replica is added once the learner is past this step
IMAGES = ("rlmesh", "rlmesh-redis", "rlmesh-prometheus")


def learner_data_overrides() -> list[str]:
    """The learner's ``data.*`` overrides in docker-compose.yml (defaults expanded): what decides
    which prompts each step draws."""
    command = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["learner"]["command"]
    expanded = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in command]
    return [a for a in expanded if a.startswith("data.")]


def say(msg: str) -> None:
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Compose]:
    work = tmp_path_factory.mktemp("compose")
    t0 = time.monotonic()
    dockerd = ensure_dockerd(work / "dockerd.log")
    tag = uuid.uuid4().hex[:8]
    compose = Compose(
        f"rlmeshtest{tag}",
        {
            "RLMESH_TAG": "test",
            "RLMESH_BASE_IMAGE": ensure_base_image(),
            "RLMESH_OS_IMAGE": BASE_IMAGE,
            # No wheel index beyond PyPI: torch comes from the local wheel fill_build_extra copies.
            "RLMESH_TORCH_INDEX_URL": "",
            "RLMESH_AUTH_TOKEN": secrets.token_hex(16),
            "RLMESH_REDIS_PASSWORD": secrets.token_hex(16),
            "PROMETHEUS_PORT": str(free_port()),
            "STEPS": str(STEPS),
            "TEST_FREQ": "20",
            "SAVE_FREQ": "5",  # the learner killed mid-run resumes from a recent checkpoint
        },
    )
    try:
        extras = fill_build_extra()
        say(f"build extras: {extras}")
        if not any(name.startswith("torch-") for name in extras):
            compose.env.pop("RLMESH_TORCH_INDEX_URL")  # no local wheel: the CPU index, not PyPI's CUDA build
        say("building the images (minutes the first time; cached after)")
        compose("build", timeout=3600, stream=True)
        build_s = time.monotonic() - t0
        sizes = {name: image_size_mb(f"{name}:test") for name in IMAGES}
        say(f"built in {build_s:.0f} s; image sizes (MB): {sizes}")
        yield compose
    finally:
        say("docker-compose down -v")
        compose("down", "-v", "--remove-orphans", check=False, timeout=300)
        dockerd.stop()


def control(compose: Compose, method: str, path: str) -> dict:
    """The stack's control plane (REST, with its token): how an operator drives the run."""
    (container,) = compose.containers("control")
    request = urllib.request.Request(
        f"http://{container_ip(container)}:8000/api/v1/{path}",
        method=method,
        headers={
            "Authorization": f"Bearer {compose.env['RLMESH_AUTH_TOKEN']}",
            "X-Rlmesh-User": "compose-test",
        },
    )
    with DIRECT.open(request, timeout=30) as r:
        return json.load(r)


def learner_step(compose: Compose) -> int:
    """The learner's step, as the control plane reports it; -1 while it cannot (starting, or gone)."""
    try:
        return control(compose, "GET", "run/status")["step"]
    except (OSError, ValueError, KeyError):
        return -1


def pause(compose: Compose) -> None:
    control(compose, "POST", "run/pause")
    wait_until(
        lambda: (st := control(compose, "GET", "run/status"))["paused"] and st["phase"] == "paused",
        300,
        "the learner to pause",
        every_s=1,
    )


def replica_info(compose: Compose, container: str):
    with grpc.insecure_channel(f"{container_ip(container)}:50053") as channel:
        return rollout_pb2_grpc.RolloutStub(channel).GetInfo(
            common_pb2.Empty(), timeout=5, metadata=bearer_metadata(compose.env["RLMESH_AUTH_TOKEN"])
        )


def tasks_done(compose: Compose, container: str) -> int:
    try:
        return replica_info(compose, container).tasks_done
    except grpc.RpcError:
        return 0  # still starting


def replica_state(compose: Compose, container: str) -> str:
    try:
        return replica_info(compose, container).state
    except grpc.RpcError:
        return "down"  # still starting


def prometheus_up(port: str) -> dict[str, list[float]]:
    """``up`` by job, from the stack's Prometheus ({} while it does not answer)."""
    try:
        with DIRECT.open(f"http://127.0.0.1:{port}/api/v1/query?query=up", timeout=5) as r:
            result = json.load(r)["data"]["result"]
    except OSError:
        return {}
    by_job: dict[str, list[float]] = {}
    for series in result:
        by_job.setdefault(series["metric"]["job"], []).append(float(series["value"][1]))
    return by_job


def planned_prompts(root: Path, steps: int) -> dict[int, list[Planned]]:
    """What the learner's seeded cursor draws for each step, from the run's own data copy."""
    overrides = [
        f"actor_rollout_ref.model.path={root / 'demo' / 'model'}",
        *[o.replace("=runs/", f"={root}/", 1) for o in learner_data_overrides()],
    ]
    cfg = load_config(str(CPU_DEMO), overrides)
    dataset = RLHFDataset.from_config(cfg.data, load_tokenizer(cfg.tokenizer_path()), split="train")
    return plan_of(dataset, PromptCursor.from_config(cfg.data, dataset), cfg.data.train_batch_size, steps)


def test_compose_trains_with_scaled_replicas(stack: Compose, tmp_path: Path):
    compose = stack
    t0 = time.monotonic()
    say("docker-compose up -d --scale rollout=3")
    compose("up", "-d", "--scale", "rollout=3", timeout=900)
    wait_until(lambda: learner_step(compose) >= 1, 900, "the learner's first step", every_s=2)
    say(f"first step after {time.monotonic() - t0:.0f} s (the warm-up of prepare included)")
    first = compose.containers("rollout")
    assert len(first) == 3

    # Prometheus found every service, the three replicas through DNS.
    port = compose.env["PROMETHEUS_PORT"]
    wait_until(
        lambda: (
            (up := prometheus_up(port)).get("rlmesh-rollout", []).count(1.0) == 3
            and all(up.get(f"rlmesh-{n}") == [1.0] for n in ("learner", "reward", "reference", "control"))
        ),
        120,
        "Prometheus to scrape learner, reward, reference, control and 3 replicas",
        every_s=2,
    )

    # The learner holds between steps while replicas come and go, so that each change lands mid-run
    # however fast this machine trains (at full speed the demo's steps take half a second).
    # The rule file is loaded, and the control plane reads its alerts from that Prometheus.
    with DIRECT.open(f"http://127.0.0.1:{port}/api/v1/rules", timeout=10) as r:
        groups = {g["name"] for g in json.load(r)["data"]["groups"]}
    assert {"rlmesh-ppo", "rlmesh-mesh"} <= groups, groups
    assert control(compose, "GET", "alerts")["source"] == "http://prometheus:9090"

    wait_until(lambda: learner_step(compose) >= SCALE_UP_AT, 900, f"step {SCALE_UP_AT}", every_s=2)
    pause(compose)
    say("docker-compose up -d --scale rollout=4 (mid-run)")
    compose("up", "-d", "--no-recreate", "--no-deps", "--scale", "rollout=4", "rollout", timeout=300)
    (added,) = set(compose.containers("rollout")) - set(first)
    wait_until(
        lambda: replica_state(compose, added) == "serving", 600, "the added replica to serve", every_s=2
    )
    control(compose, "POST", "run/resume")
    wait_until(lambda: tasks_done(compose, added) > 0, 600, "the added replica to take work", every_s=1)
    joined_at = learner_step(compose)
    listed = control(compose, "GET", "replicas")
    assert len(listed["replicas"]) == 4, listed
    say(f"the added replica took work by step {joined_at}")
    wait_until(
        lambda: prometheus_up(port).get("rlmesh-rollout", []).count(1.0) == 4,
        120,
        "Prometheus to find the fourth replica",
        every_s=2,
    )

    pause(compose)
    removed = first[0]
    removed_id = replica_info(compose, removed).replica_id
    say(f"docker stop {removed[:12]} (a first replica leaves mid-run)")
    run(["docker", "stop", "-t", "60", removed])
    assert container_state(removed)["ExitCode"] == 0, compose.logs("rollout")[-3000:]
    removed_at = learner_step(compose)

    # The learner dies (held between steps, so that it dies mid-run on any machine): its container
    # restarts (restart: on-failure), the new learner takes the lease once it lapses (the same
    # hostname, maybe the same pid: not known dead), resumes from the checkpoint and goes on.
    (learner,) = compose.containers("learner")
    killed_pid = kill_service_process(learner)
    say(f"kill -9 of the learner (host pid {killed_pid}) at step {removed_at}")
    wait_until(
        lambda: inspect(learner)["RestartCount"] >= 1, 300, "the learner's container to restart", every_s=1
    )
    wait_until(
        lambda: learner_step(compose) > removed_at,
        900,
        "the restarted learner to go past its step",
        every_s=2,
    )
    say(f"the restarted learner is at step {learner_step(compose)}")

    wait_until(lambda: not container_state(learner)["Running"], 1800, "the learner to finish", every_s=3)
    code = container_state(learner)["ExitCode"]
    learner_log = compose.logs("learner")
    assert code == 0, learner_log[-5000:]
    assert removed_at < STEPS, "the replica left after the run's end: nothing was tested"
    say("docker-compose run --rm export")
    say(compose("run", "--rm", "export", timeout=600).stdout.strip().splitlines()[-1])
    wall_s = time.monotonic() - t0
    say(f"run done: {STEPS} steps, wall time from `up` to the exported actor {wall_s:.0f} s")

    # Every live replica got every push: each holds the run's last policy version.
    (redis_container,) = compose.containers("redis")
    redis_host = container_ip(redis_container)
    with pytest.raises(redis.AuthenticationError):  # the default user is off
        redis.Redis(host=redis_host, port=6379).get("x")
    r = redis.Redis(
        host=redis_host,
        port=6379,
        username="rlmesh",
        password=compose.env["RLMESH_REDIS_PASSWORD"],
        decode_responses=True,
    )
    keys = RunKeys("compose")
    version = int(r.hget(keys.scoped("policy"), "version"))
    assert version >= STEPS
    live = [c for c in compose.containers("rollout") if container_state(c)["Running"]]
    assert len(live) == 3 and added in live and removed not in live
    versions = {c[:12]: replica_info(compose, c).policy_version for c in live}
    assert set(versions.values()) == {version}, f"replicas' versions {versions}, the run's {version}"
    # Pushes dropped a replica only when it was the one stopped (a push racing its drain).
    dropped = [ln for ln in learner_log.splitlines() if "dropped from the push" in ln]
    assert all(removed_id in ln for ln in dropped), dropped

    # Nothing lost: nothing pending on the streams, nothing dead-lettered.
    for stream in (keys.prompts, keys.trajectories):
        pending = sum(g["pending"] for g in r.xinfo_groups(stream)) if r.exists(stream) else 0
        assert pending == 0, f"{stream}: {pending} entries pending"
    assert r.xlen(keys.dead_letters) == 0 if r.exists(keys.dead_letters) else True

    # Every step trained exactly its planned prompts, each with all its samples, none twice.
    out = tmp_path / "runs"
    run(["docker", "cp", f"{learner}:/app/runs", str(out)])
    cfg = load_config(str(CPU_DEMO), [])
    audit_groups(
        out / "compose" / "checkpoints" / "trained_groups.jsonl",
        planned_prompts(out, STEPS),
        cfg.actor_rollout_ref.rollout.n,
    )
    assert (out / "compose" / "actor-hf" / "config.json").is_file()
    say(
        f"checked: {len(live)} live replicas at v{version}, the added one joined by step {joined_at}, "
        f"one left at step {removed_at}; images (MB) "
        + ", ".join(f"{n} {image_size_mb(n + ':test'):.0f}" for n in IMAGES)
    )
