"""A replica in its own network namespace (own IP, reached over a veth pair) registers an address
the learner can dial, and a weight push from this side reaches its engine: bound to its IP, and
bound to 0.0.0.0 advertising an address from env RLMESH_ADVERTISE_HOST. Needs root and iproute2."""

import asyncio
import secrets
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.config import load_config
from rlmesh.engine.client import EngineClient
from rlmesh.learner.weight_sync.push import WeightPusher, weight_master_address
from rlmesh.models import build_tiny_model, build_tokenizer
from rlmesh.queue import ReplicaRegistry, RunKeys, connect
from rlmesh.runtime.health import grpc_health
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.net import ENV_ADVERTISE_HOST, is_loopback
from tests.support.polling import eventually

TOKEN = secrets.token_hex(8)
PUSHED_VERSION = 7


@dataclass
class Net:
    ns: str
    host_ip: str  # this side of the veth pair: Redis and the learner (this test)
    ns_ip: str  # the namespace's own address
    alias_ip: str  # a second address in the namespace, which only configuration names


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.fail(
            f"`ip {' '.join(args)}` failed ({done.stderr.strip()}): these tests need root (CAP_NET_ADMIN) "
            "and iproute2 to make a network namespace and a veth pair",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def net():
    if shutil.which("ip") is None:
        pytest.fail(
            "iproute2's `ip` is not on PATH: these tests make a network namespace with it", pytrace=False
        )
    uid = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"rlmesh-{uid}", f"rmh{uid}", f"rmn{uid}"
    subnet = f"10.213.{int(uid[:2], 16) % 250 + 1}"
    result = Net(ns, f"{subnet}.1", f"{subnet}.2", f"{subnet}.3")
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{result.host_ip}/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        for args in (
            ("addr", "add", f"{result.ns_ip}/24", "dev", ns_if),
            ("addr", "add", f"{result.alias_ip}/24", "dev", ns_if),
            ("link", "set", ns_if, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("netns", "exec", ns, "ip", *args)
        yield result
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tok = build_tokenizer()
    kw = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    start = build_tiny_model(tmp_path_factory.mktemp("start"), tok, seed=1, **kw)
    target = build_tiny_model(tmp_path_factory.mktemp("target"), tok, seed=2, **kw)
    return start, AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stack(net, tmp_path_factory):
    # Processes stop (launcher exit) before the namespace goes (net's finalizer).
    with ProcessLauncher(tmp_path_factory.mktemp("netns"), stop_grace_s=10) as launcher:
        # Bound beyond loopback, Redis takes clients from the namespace only with a password.
        redis = launcher.start_redis(host=net.host_ip, password=secrets.token_hex(8), appendonly=False)
        yield launcher, redis


def start_replica_in_namespace(launcher, redis, net, models, run, overrides, env=None):
    start, _ = models
    argv = ["ip", "netns", "exec", net.ns, sys.executable, "-m", "rlmesh.cli", "serve", "rollout"]
    return launcher.start_service(
        "rollout",
        name=f"replica-{run}",
        argv_prefix=argv,
        overrides=[
            f"rlmesh.run_id={run}",
            f"rlmesh.redis_url={redis.url}",
            f"rlmesh.auth_token={TOKEN}",
            f"actor_rollout_ref.model.path={start}",
            f"rlmesh.sampler.replica_id={run}",
            "rlmesh.reference.colocated=true",
            "rlmesh.rollout.port=0",
            "rlmesh.rollout.metrics_port=0",
            "rlmesh.log_format=text",
            *overrides,
        ],
        env=env,
        timeout_s=60,
    )


async def registration(redis_url, run):
    redis = connect(redis_url)
    try:
        live = await ReplicaRegistry(redis, RunKeys(run)).live()
        return live[0] if live else None
    finally:
        await redis.aclose()


async def push(engine_url, master, target):
    client = EngineClient(engine_url, timeout_s=60, token=TOKEN)
    pusher = WeightPusher(
        [client], backend="gloo", master_address=master, timeout_s=45, bucket_bytes=64 << 10, verify_tensors=4
    )
    try:
        report = await pusher.push(target.state_dict().items(), version=PUSHED_VERSION)
        mismatches = await pusher.verify(dict(list(target.state_dict().items())[:4]))
    finally:
        await pusher.close()
        await client.aclose()
    return report, mismatches


def check_push_arrives(redis, run, reg, learner_overrides, models, expected_master):
    """The learner's side as the learner runs it: its rendezvous host from its config, then a push to
    the engine URL the replica registered; the engine and then the replica report the new version."""
    _, target = models
    master = weight_master_address(load_config(None, [f"rlmesh.redis_url={redis.url}", *learner_overrides]))
    assert master == expected_master
    report, mismatches = asyncio.run(push(reg.engine_url, master, target))
    assert not report.failed, report.failed
    assert mismatches and all(m == [] for m in mismatches.values()), mismatches
    headers = {"Authorization": f"Bearer {TOKEN}"}
    info = httpx.get(reg.engine_url + "/get_model_info", headers=headers, timeout=30).json()
    assert info["weight_version"] == str(PUSHED_VERSION)

    async def replica_version():
        found = await registration(redis.url, run)
        return found.policy_version if found else None

    asyncio.run(eventually(replica_version, PUSHED_VERSION, "the replica's registered policy version"))


def test_a_replica_bound_to_its_own_ip_registers_it_and_takes_a_push(net, stack, models, monkeypatch):
    monkeypatch.delenv(ENV_ADVERTISE_HOST, raising=False)
    launcher, redis = stack
    run = f"netns-a-{uuid.uuid4().hex[:6]}"
    replica = start_replica_in_namespace(
        launcher, redis, net, models, run, [f"rlmesh.rollout.host={net.ns_ip}"]
    )
    reg = asyncio.run(registration(redis.url, run))
    assert reg is not None, "the replica did not register"
    engine = urlsplit(reg.engine_url)
    assert reg.grpc_address.rsplit(":", 1)[0] == net.ns_ip == engine.hostname
    assert not is_loopback(engine.hostname)
    assert grpc_health(reg.grpc_address, timeout_s=5) == "SERVING"  # dialled from this namespace
    # The learner bound to its veth address: that is the rendezvous the engine dials.
    check_push_arrives(redis, run, reg, [f"rlmesh.learner.host={net.host_ip}"], models, net.host_ip)
    assert launcher.stop(replica.process) == 0


def test_a_replica_bound_to_the_wildcard_advertises_the_address_it_is_given(net, stack, models, monkeypatch):
    """As behind NAT or in a container: it binds 0.0.0.0 and advertises what env RLMESH_ADVERTISE_HOST
    says (here a second address of the namespace, which it would never pick itself)."""
    monkeypatch.delenv(ENV_ADVERTISE_HOST, raising=False)
    launcher, redis = stack
    run = f"netns-b-{uuid.uuid4().hex[:6]}"
    replica = start_replica_in_namespace(
        launcher,
        redis,
        net,
        models,
        run,
        ["rlmesh.rollout.host=0.0.0.0"],
        env={ENV_ADVERTISE_HOST: net.alias_ip},
    )
    reg = asyncio.run(registration(redis.url, run))
    assert reg is not None, "the replica did not register"
    assert reg.grpc_address == f"{net.alias_ip}:{replica.grpc_address.rsplit(':', 1)[1]}"
    assert urlsplit(reg.engine_url).hostname == net.alias_ip
    assert grpc_health(reg.grpc_address, timeout_s=5) == "SERVING"
    # The learner bound to the wildcard with nothing set: the address it routes to Redis from.
    check_push_arrives(redis, run, reg, ["rlmesh.learner.host=0.0.0.0"], models, net.host_ip)
    assert launcher.stop(replica.process) == 0
