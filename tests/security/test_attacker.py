"""The attacker's suite (``make security-test``): a real job, every service a process with the run's
token and a Redis password, attacked while it trains by someone who can reach every port and write
to Redis but does not hold the token. Every call without the token (or with a wrong one) is refused,
reflection streams cannot starve the token's callers, cross-site and rebinding requests are
refused, forged Redis entries (replicas, reward services, trajectories, the policy record) are
skipped and counted, oversized bodies and NaN or out-of-range values are refused; the run goes on,
trains only its planned prompts, and the token and the Redis password are in no log, endpoint,
checkpoint or tracker file. docs/security.md"""

from __future__ import annotations

import asyncio
import re
import secrets
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import redis as redis_sync
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlmesh.job.stack import Stack, start_stack
from rlmesh.queue import connect, trajectory_queue
from rlmesh.queue.keys import RunKeys
from rlmesh.queue.policy import publish_policy
from rlmesh.queue.registry import ReplicaRegistry
from rlmesh.reward.addresses import set_reward_addresses
from rlmesh.runtime.auth import bearer_metadata
from rlmesh.runtime.health import grpc_health, scrape_metrics
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import (
    common_pb2,
    learner_pb2,
    learner_pb2_grpc,
    reference_pb2,
    reference_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2_grpc,
    trajectory_pb2,
)
from tests.support import raw_http
from tests.support.jobs import LONG_RUN_STEPS, Files, audit, committed_steps, make_files, overrides
from tests.support.polling import wait_until
from tests.support.repo import CPU_DEMO

pytestmark = [pytest.mark.security, pytest.mark.timeout(900)]

TOKEN = f"attack-suite-{secrets.token_hex(12)}"
WRONG = f"wrong-{secrets.token_hex(12)}"
MAX_CONCURRENT_RPCS = 16
MAX_REQUEST_MB = 4


@dataclass
class Target:
    stack: Stack
    files: Files
    run_dir: Path
    root: Path
    run_id: str
    redis_password: str
    seen: dict[str, str] = field(default_factory=dict)  # endpoint -> what it answered

    def address(self, name: str) -> str:
        instance = self.stack.get(name)
        assert instance is not None, f"{name} was not started"
        return instance.grpc_address

    def learner_status(self) -> learner_pb2.LearnerStatus:
        with grpc.insecure_channel(self.address("learner")) as channel:
            return learner_pb2_grpc.LearnerStub(channel).GetStatus(
                common_pb2.Empty(), timeout=30, metadata=bearer_metadata(TOKEN)
            )

    def engine_url(self) -> str:
        with grpc.insecure_channel(self.stack.rollouts[0].grpc_address) as channel:
            info = rollout_pb2_grpc.RolloutStub(channel).GetInfo(
                common_pb2.Empty(), timeout=30, metadata=bearer_metadata(TOKEN)
            )
        return info.engine_url

    def control(self) -> str:
        url = self.stack.control_url
        assert url is not None, "the control plane was not started"
        return url

    def steps_on(self, more: int, what: str) -> None:
        """The learner commits ``more`` steps beyond where it is now."""
        start = self.learner_status().step
        wait_until(lambda: self.learner_status().step >= start + more, 300, what, every_s=0.2)


class Listener:
    """The attacker's own service on loopback: it records every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(65536))
                except OSError:
                    self.received.append(b"")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("attack")
    files = make_files(root / "files")
    run_dir = root / "run"
    run_id = f"attack-{uuid.uuid4().hex[:6]}"
    argv = [
        *overrides(files, run_dir, LONG_RUN_STEPS),
        f"rlmesh.run_id={run_id}",
        f"rlmesh.auth_token={TOKEN}",  # the launcher hands it over in the environment, not argv
        "rlmesh.rollout.replicas=1",
        "rlmesh.reference.colocated=false",  # the reference service is one more port to attack
        "rlmesh.control.enabled=true",
        f"rlmesh.runtime.grpc_max_concurrent_rpcs={MAX_CONCURRENT_RPCS}",
        f"rlmesh.runtime.grpc_max_request_mb={MAX_REQUEST_MB}",
        "trainer.logger=['console','tensorboard','mlflow']",  # tracker files to search for secrets
    ]
    with ProcessLauncher(root / "work", stop_grace_s=30) as launcher:
        stack = start_stack(launcher, str(CPU_DEMO), argv, say=lambda m: None)
        assert stack.redis is not None and stack.redis.password
        target = Target(stack, files, run_dir, root, run_id, stack.redis.password)
        target.steps_on(2, "the run's first steps")
        yield target


def grpc_code(call, *args, **kw) -> grpc.StatusCode:
    try:
        call(*args, timeout=30, **kw)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_every_port_refuses_a_caller_without_the_token(target: Target):
    calls = {
        "reward": (reward_pb2_grpc.RewardStub, "Score", reward_pb2.ScoreRequest()),
        "reference": (reference_pb2_grpc.ReferenceStub, "LogProbs", reference_pb2.LogProbsRequest()),
        "rollout-0": (rollout_pb2_grpc.RolloutStub, "GetInfo", common_pb2.Empty()),
        "learner": (learner_pb2_grpc.LearnerStub, "Stop", learner_pb2.StopRequest()),
    }
    for name, (stub, method, request) in calls.items():
        with grpc.insecure_channel(target.address(name)) as channel:
            for metadata in ((), bearer_metadata(WRONG)):
                code = grpc_code(getattr(stub(channel), method), request, metadata=metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (name, method, code)
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(), timeout=30, metadata=metadata
                )
                with pytest.raises(grpc.RpcError) as refused:
                    next(watch)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert grpc_health(target.address(name)) == "SERVING"  # probes need no secret

    engine = target.engine_url()
    for path in ("/generate", "/init_weights_update_group", "/update_weights_from_distributed",
                 "/get_weights_by_name", "/pause_generation", "/flush_cache"):  # fmt: skip
        for headers in ({}, {"Authorization": f"Bearer {WRONG}"}):
            answer = httpx.post(engine + path, json={}, headers=headers, timeout=30)
            assert answer.status_code == 401, (path, answer.status_code)
    control = target.control()
    for method, path in (("GET", "/run/status"), ("GET", "/run/config"), ("POST", "/run/stop")):
        for headers in ({}, {"Authorization": f"Bearer {WRONG}"}):
            answer = httpx.request(method, f"{control}/api/v1{path}", headers=headers, timeout=30)
            assert answer.status_code == 401, (method, path, answer.status_code)

    redis = target.stack.redis
    assert redis is not None
    with pytest.raises(redis_sync.AuthenticationError):
        redis_sync.Redis(host=redis.host, port=redis.port, socket_timeout=5).get("x")
    target.steps_on(1, "a step after the calls without the token")


def test_a_flood_of_streams_without_the_token_takes_no_slot(target: Target):
    with grpc.insecure_channel(target.address("learner")) as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        never = threading.Event()

        def idle_requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
            never.wait(60)  # a stream that sends nothing and stays open
            yield from ()

        flood = [
            reflection.ServerReflectionInfo(idle_requests(), timeout=60)
            for _ in range(3 * MAX_CONCURRENT_RPCS)
        ]
        flood += [
            health.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(MAX_CONCURRENT_RPCS)
        ]
        try:
            # With the flood open, a caller with the token is still answered, several times over.
            for _ in range(MAX_CONCURRENT_RPCS + 2):
                status = learner_pb2_grpc.LearnerStub(channel).GetStatus(
                    common_pb2.Empty(), timeout=30, metadata=bearer_metadata(TOKEN)
                )
                assert status.run_id == target.run_id
            for call in flood:
                with pytest.raises(grpc.RpcError) as refused:
                    next(call)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            never.set()
            for call in flood:
                call.cancel()


def test_cross_site_and_rebinding_requests_are_refused_even_with_the_token(target: Target):
    control = target.control()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    refusals = {
        # A page on another site posting to the control plane (the browser adds its Origin).
        "cross-site": (403, {**auth, "Origin": "http://evil.example", "Content-Type": "application/json"}),
        # A DNS-rebinding page: the browser sends the attacker's name as Host.
        "rebinding": (421, {**auth, "Host": "evil.example:8000", "Content-Type": "application/json"}),
        # An HTML form's "simple" request needs no preflight: refused for its content type.
        "form": (415, {**auth, "Content-Type": "text/plain"}),
    }
    for what, (status, headers) in refusals.items():
        answer = httpx.post(f"{control}/api/v1/run/pause", content=b"{}", headers=headers, timeout=30)
        assert answer.status_code == status, (what, answer.status_code, answer.text)
        assert answer.headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
    engine = target.engine_url()
    answer = httpx.post(
        engine + "/pause_generation", json={}, headers={**auth, "Host": "evil.example"}, timeout=30
    )
    assert answer.status_code == 421
    assert not target.learner_status().paused
    target.steps_on(1, "a step after the cross-site requests")


def test_forged_redis_entries_are_skipped_and_nothing_reaches_the_attacker(target: Target):
    """The attacker holds the Redis password (a leak), not the token."""
    listener = Listener()
    attacker_url = f"127.0.0.1:{listener.port}"
    unsigned, forged = RunKeys(target.run_id), RunKeys.signed(target.run_id, WRONG)

    async def forge() -> list[str]:
        redis = connect(target.stack.redis_url)
        try:
            for keys, replica_id in ((unsigned, "evil-unsigned"), (forged, "evil-forged")):
                await ReplicaRegistry(redis, keys, ttl_s=600).register(
                    trajectory_pb2.ReplicaRegistration(
                        replica_id=replica_id,
                        grpc_address=attacker_url,
                        engine_url=f"http://{attacker_url}",
                        policy_version=0,
                    )
                )
            await set_reward_addresses(redis, unsigned, [attacker_url])
            await publish_policy(redis, forged, 10**6, "/etc/passwd")
            # Trajectories for groups the learner is waiting for, read off the prompt stream.
            # (A task leaves the stream once answered: wait for a step's tasks to be there.)
            deadline = asyncio.get_running_loop().time() + 120
            while not (entries := await redis.xrevrange(unsigned.prompts, count=4)):
                assert asyncio.get_running_loop().time() < deadline, "no prompt task to forge an answer for"
                await asyncio.sleep(0.005)
            tasks = [trajectory_pb2.PromptTask.FromString(f[b"p"]) for _, f in entries]
            uids = []
            for keys in (unsigned, forged):
                queue = trajectory_queue(redis, keys, "attacker")
                forgeries = [
                    trajectory_pb2.Trajectory(
                        uid=f"forged-{uuid.uuid4().hex[:8]}",
                        group_uid=task.group_uid,
                        task_uid=task.uid,
                        prompt_ids=list(task.prompt_ids),
                        response_ids=[1, 2, 3],
                        score=1.0,
                        replica_id="evil",
                    )
                    for task in tasks
                ]
                await queue.put(forgeries)
                uids += [t.uid for t in forgeries]
            return uids
        finally:
            await redis.aclose()

    forged_uids = asyncio.run(forge())
    target.steps_on(3, "three steps after the forged entries")
    listener.close()
    assert listener.received == [], "a service called the attacker's address"

    learner = target.stack.get("learner")
    assert learner is not None and learner.metrics_port
    page = scrape_metrics("127.0.0.1", learner.metrics_port)
    untrusted = {
        (m[1], m[2]): float(m[3])
        for m in re.finditer(r'rlmesh_redis_untrusted_total\{cause="(\w+)",what="(\w+)"\} (\S+)', page)
    }
    by_what = {what: n for (cause, what), n in untrusted.items() if n > 0}
    assert {"registry", "trajectories"} <= set(by_what), untrusted

    async def dead_lettered() -> set[str]:
        redis = connect(target.stack.redis_url)
        try:
            rows = await redis.xrange(unsigned.dead_letters)
        finally:
            await redis.aclose()
        found = set()
        for _, fields in rows:
            if b"p" in fields:
                found.add(trajectory_pb2.Trajectory.FromString(fields[b"p"]).uid)
        return found

    assert set(forged_uids) <= asyncio.run(dead_lettered())
    # A replica that joins now (restarted) gets the learner's weights, not the forged record's file.
    (name,) = [s.name for s in target.stack.rollouts]
    target.stack.restart(name)

    def replica_version() -> int:
        with grpc.insecure_channel(target.stack.rollouts[0].grpc_address) as channel:
            return (
                rollout_pb2_grpc.RolloutStub(channel)
                .GetInfo(common_pb2.Empty(), timeout=30, metadata=bearer_metadata(TOKEN))
                .policy_version
            )

    wait_until(lambda: replica_version() > 0, 300, "the restarted replica to get the learner's weights")
    target.steps_on(1, "a step with the restarted replica")
    assert replica_version() <= target.learner_status().policy_version < 10**6
    assert "/etc/passwd" not in target.stack.rollouts[0].process.log_path.read_text()


def test_oversized_bodies_are_refused_while_they_are_read(target: Target):
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    engine = target.engine_url()
    host = {"Host": engine.split("//", 1)[1]}
    assert raw_http.declared_only(engine, "/generate", 1 << 40, {**auth, **host}).status == 413
    chunked = raw_http.chunked_unfinished(engine, "/generate", (64 << 20) + 1, {**auth, **host})
    assert chunked.status == 413
    control = target.control()
    chost = {"Host": control.split("//", 1)[1]}
    assert raw_http.declared_only(control, "/api/v1/run/pause", 2 << 20, {**auth, **chost}).status == 413
    big = reward_pb2.ScoreRequest(
        samples=[reward_pb2.RewardSample(uid="u", response_text="x" * ((MAX_REQUEST_MB + 1) << 20))]
    )
    with grpc.insecure_channel(target.address("reward")) as channel:
        code = grpc_code(reward_pb2_grpc.RewardStub(channel).Score, big, metadata=bearer_metadata(TOKEN))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert httpx.get(engine + "/health", timeout=30).status_code == 200
    target.steps_on(1, "a step after the oversized bodies")


def test_nan_and_out_of_range_values_are_refused(target: Target):
    control = target.control()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    before = httpx.get(f"{control}/api/v1/hyperparams", headers=headers, timeout=30).json()
    for body in (b'{"actor_lr": NaN}', b'{"actor_lr": Infinity}', b'{"actor_lr": 5}', b'{"clip_ratio": -1}'):
        answer = httpx.patch(f"{control}/api/v1/hyperparams", content=body, headers=headers, timeout=30)
        assert answer.status_code == 422, (body, answer.status_code, answer.text)
    with grpc.insecure_channel(target.address("learner")) as channel:
        stub = learner_pb2_grpc.LearnerStub(channel)
        for request in (
            learner_pb2.UpdateHyperparamsRequest(actor_lr=1e9),
            learner_pb2.UpdateHyperparamsRequest(actor_lr=float("nan")),
        ):
            code = grpc_code(stub.UpdateHyperparams, request, metadata=bearer_metadata(TOKEN))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
    after = httpx.get(f"{control}/api/v1/hyperparams", headers=headers, timeout=30).json()
    for name in ("actor_lr", "clip_ratio"):  # (an adaptive kl_coef moves on by itself)
        assert after["values"][name] == before["values"][name]
    target.steps_on(1, "a step after the bad values")


def test_the_run_went_on_and_trained_only_its_planned_prompts(target: Target):
    control = target.control()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for path in ("/run/config", "/run/status", "/hyperparams", "/replicas", "/rewards", "/audit"):
        answer = httpx.get(f"{control}/api/v1{path}", headers=headers, timeout=60)
        target.seen[path] = answer.text
    for name, instance in [(s.name, s) for s in target.stack.started]:
        if instance.metrics_port:
            target.seen[f"{name} /metrics"] = scrape_metrics("127.0.0.1", instance.metrics_port)
    target.seen["learner status"] = str(target.learner_status())

    answer = httpx.post(f"{control}/api/v1/run/stop", json={"checkpoint": True}, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    learner = target.stack.get("learner")
    assert learner is not None
    wait_until(lambda: not learner.process.alive(), 300, "the learner to stop")
    assert learner.process.popen.returncode == 0
    committed = committed_steps(target.run_dir)
    assert committed >= 8
    audit(target.files, target.run_dir, committed)


def test_no_secret_is_in_any_log_endpoint_checkpoint_or_tracker_file(target: Target):
    secrets_ = {"token": TOKEN.encode(), "redis password": target.redis_password.encode()}
    redis = target.stack.redis
    assert redis is not None
    # Redis's own config file holds its password by design (mode 0600); its data holds no secret.
    exempt = {redis.data_dir / "secrets.conf"}
    scanned = 0
    for path in target.root.rglob("*"):
        if not path.is_file() or path in exempt:
            continue
        data = path.read_bytes()
        scanned += 1
        for what, secret in secrets_.items():
            assert secret not in data, f"the {what} is in {path}"
    assert scanned > 20  # logs, checkpoints, metrics and tracker files were there to scan
    assert any(p.suffix == ".log" for p in target.root.rglob("*.log"))
    for endpoint, text in target.seen.items():
        for what, secret in secrets_.items():
            assert secret.decode() not in text, f"the {what} is in {endpoint}"
    assert "/run/config" in target.seen and "auth_token" in target.seen["/run/config"]
