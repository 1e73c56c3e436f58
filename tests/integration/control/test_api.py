"""The control plane's REST API against real parts: ``rlmesh serve control`` and a learner service
as processes, on a private Redis. The learner has no replica, so it stays at step 0 serving its
control RPCs; the run's history, queues and registry entries are written the way the learner,
the replicas and the queues write them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from urllib.parse import urlsplit

import httpx
import pytest

from rlmesh.config import load_config
from rlmesh.control.plane import ControlPlane
from rlmesh.queue import ReplicaRegistry, RunKeys, connect, prompt_queue
from rlmesh.queue.run_info import publish_step_metrics
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import trajectory_pb2
from tests.support.control import AUTH, NO_REWARD, TOKEN, start_control_stack
from tests.support.processes import child_env
from tests.support.repo import CPU_DEMO


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with ProcessLauncher(tmp_path_factory.mktemp("control"), stop_grace_s=10) as launcher:
        stack = start_control_stack(launcher, tmp_path_factory.mktemp("files"))
        stack.launcher = launcher
        yield stack


@pytest.fixture
def api(stack):
    with stack.client() as client:
        yield client


def test_every_route_but_health_and_metrics_wants_the_token(stack):
    with httpx.Client(base_url=stack.url) as anon:
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200
        for path in ("/api/v1/run/status", "/docs", "/openapi.json"):
            r = anon.get(path)
            assert r.status_code == 401 and path in r.json()["message"], path
        r = anon.get("/api/v1/run/status", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "invalid bearer token" in r.json()["message"]
        assert anon.get("/openapi.json", headers=AUTH).json()["info"]["title"] == "rlmesh control plane"


def test_status_config_and_the_live_hyperparameters(api, stack):
    st = api.get("/api/v1/run/status").json()
    assert st["run_id"] == stack.run_id and st["step"] == 0 and st["total_steps"] >= 1
    assert st["eta_s"] is None  # no step timed yet
    assert set(st["hyperparams"]) >= {"actor_lr", "kl_coef", "kl_loss_coef", "entropy_coeff", "clip_ratio"}
    assert "critic_lr" not in st["hyperparams"]  # grpo: no critic
    config = api.get("/api/v1/run/config").json()
    assert config["source"] == "learner"
    assert config["config"]["rlmesh"]["auth_token"] == "***"  # published without its secret
    text = api.get("/api/v1/run/config").text
    assert TOKEN not in text
    password = urlsplit(stack.redis_url).password
    assert password and password not in text and ":***@" in config["config"]["rlmesh"]["redis_url"]
    hp = api.get("/api/v1/hyperparams").json()
    assert hp["fields"]["actor_lr"]["key"] == "actor_rollout_ref.actor.optim.lr"


def test_a_change_reaches_the_learner_and_the_audit_log(api):
    before = api.get("/api/v1/hyperparams").json()["values"]
    r = api.patch("/api/v1/hyperparams", json={"actor_lr": 2.5e-4, "top_p": 0.9, "kl_loss_coef": 0.05})
    assert r.status_code == 200, r.text
    assert r.json()["applies_from_step"] == 1
    assert r.json()["values"]["actor_lr"] == 2.5e-4
    # The learner holds them as pending: its status shows them in force from the next step.
    now = api.get("/api/v1/run/status").json()["hyperparams"]
    assert (now["actor_lr"], now["top_p"], now["kl_loss_coef"]) == (2.5e-4, 0.9, 0.05)
    entries = api.get("/api/v1/audit", params={"action": "set_hyperparam"}).json()["entries"]
    by_target = {e["target"]: e for e in entries[:3]}
    assert by_target["actor_lr"]["old"] == before["actor_lr"] and by_target["actor_lr"]["new"] == 2.5e-4
    assert by_target["top_p"]["who"].startswith("tester@")
    assert by_target["top_p"]["source"] == "api" and by_target["top_p"]["time"] > 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"actor_lr": 0}, "actor_lr"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": "hot"}, "temperature"),
        ({"kl_coef": -1}, "kl_coef"),
        ({"learning_rate": 0.1}, "learning_rate"),
        ([1, 2], "body"),
    ],
)
def test_a_bad_change_is_a_422_naming_the_field(api, body, field):
    r = api.patch("/api/v1/hyperparams", json=body)
    assert r.status_code == 422, r.text
    assert field in r.text


def test_malformed_and_empty_bodies_are_4xx(api):
    r = api.patch("/api/v1/hyperparams", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = api.patch("/api/v1/hyperparams", json={})
    assert r.status_code == 422 and "at least one field" in r.json()["detail"]
    r = api.patch("/api/v1/hyperparams", json={"critic_lr": 1e-5})
    assert r.status_code == 409 and "critic_lr" in r.json()["detail"]
    r = api.get("/api/v1/run/metrics", params={"start": 5, "end": 2})
    assert r.status_code == 422 and "end" in r.json()["detail"]
    r = api.post("/api/v1/dead-letters/not-an-id/replay")
    assert r.status_code == 422 and "dead_letter_id" in r.text


def test_pause_resume_and_a_checkpoint_before_any_step(api):
    assert api.post("/api/v1/run/pause").json()["paused"] is True
    assert api.get("/api/v1/run/status").json()["paused"] is True
    assert api.post("/api/v1/run/resume").json()["paused"] is False
    r = api.post("/api/v1/run/checkpoint")
    assert r.status_code == 409 and "nothing to checkpoint" in r.json()["detail"]
    actions = [e["action"] for e in api.get("/api/v1/audit", params={"limit": 2}).json()["entries"]]
    assert actions == ["resume", "pause"]


async def test_history_validation_and_eta_from_the_metrics_stream(api, stack):
    redis = connect(stack.redis_url)
    keys = RunKeys(stack.run_id)
    try:
        await publish_step_metrics(redis, keys, 0, {"val/score": 0.25}, maxlen=100)
        for step in (1, 2, 3):
            await publish_step_metrics(
                redis,
                keys,
                step,
                {"timing_s/step": 2.0, "actor/lr": 1e-4 * step, "bad": float("nan")},
                maxlen=100,
            )
        await publish_step_metrics(
            redis, keys, 2, {"timing_s/step": 4.0, "actor/lr": 9.0}, maxlen=100
        )  # redone
    finally:
        await redis.aclose()
    rows = api.get("/api/v1/run/metrics", params={"keys": "actor/lr", "start": 1, "end": 2}).json()["rows"]
    assert [(r["step"], r["metrics"]) for r in rows] == [(1, {"actor/lr": 1e-4}), (2, {"actor/lr": 9.0})]
    assert "bad" not in api.get("/api/v1/run/metrics/keys").json()["keys"]
    assert [(r["step"], r["metrics"]) for r in api.get("/api/v1/run/validation").json()["rows"]] == [
        (0, {"val/score": 0.25})
    ]
    st = api.get("/api/v1/run/status").json()
    assert st["mean_step_s"] == pytest.approx((2.0 + 4.0 + 2.0) / 3, abs=1e-3)
    assert st["eta_s"] == pytest.approx(st["mean_step_s"] * st["total_steps"], abs=0.1)


async def test_replicas_are_listed_and_a_lost_one_removed(api, stack):
    redis = connect(stack.redis_url)
    registry = ReplicaRegistry(redis, RunKeys.signed(stack.run_id, TOKEN), ttl_s=60)
    try:
        await registry.register(
            trajectory_pb2.ReplicaRegistration(
                replica_id="gone-1",
                grpc_address="127.0.0.1:1",
                engine="embedded",
                policy_version=3,
                state="serving",
            )
        )
        [row] = api.get("/api/v1/replicas").json()["replicas"]
        assert (row["replica_id"], row["address"], row["policy_version"]) == ("gone-1", "127.0.0.1:1", 3)
        assert row["health"].startswith("UNREACHABLE") and row["tokens_per_s"] is None
        assert row["heartbeat_age_s"] >= 0
        assert api.post("/api/v1/replicas/nope/drain").status_code == 404
        r = api.post("/api/v1/replicas/gone-1/drain")
        assert r.status_code == 503 and "127.0.0.1:1" in r.json()["detail"]
        r = api.delete("/api/v1/replicas/gone-1")
        assert r.status_code == 200 and "not drained" in r.json()["detail"]
        assert await registry.live() == []
    finally:
        await redis.aclose()


def test_reward_services_add_remove_and_swap(api):
    listed = api.get("/api/v1/rewards").json()
    assert listed["source"] == "config" and listed["rewards"][0]["address"] == NO_REWARD
    assert listed["rewards"][0]["health"].startswith("UNREACHABLE")
    r = api.post("/api/v1/rewards", json={"address": "127.0.0.1:2"})
    assert r.status_code == 409 and "not serving" in r.json()["detail"]  # nothing was changed
    r = api.post("/api/v1/rewards", json={"address": "not an address"})
    assert r.status_code == 422 and "address" in r.json()["detail"]
    assert api.post("/api/v1/rewards", json={"address": "127.0.0.1:2", "force": True}).json()[
        "addresses"
    ] == [
        NO_REWARD,
        "127.0.0.1:2",
    ]
    assert api.get("/api/v1/rewards").json()["source"] == "redis"
    assert api.delete(f"/api/v1/rewards/{NO_REWARD}").json()["addresses"] == ["127.0.0.1:2"]
    assert api.delete("/api/v1/rewards/127.0.0.1:2").status_code == 409  # the last one: swap instead
    r = api.put("/api/v1/rewards", json={"addresses": [NO_REWARD], "force": True})
    assert r.json()["addresses"] == [NO_REWARD]
    swap = api.get("/api/v1/audit", params={"action": "swap_rewards"}).json()["entries"][0]
    assert (swap["old"], swap["new"]) == (["127.0.0.1:2"], [NO_REWARD])


async def test_queue_depths_dead_letters_and_replay(api, stack):
    redis = connect(stack.redis_url)
    keys = RunKeys.signed(stack.run_id, TOKEN)
    queue = prompt_queue(redis, keys, "test-consumer", max_deliveries=1)
    try:
        await queue.ensure_group()
        before = api.get("/api/v1/queues").json()["prompts"]["length"]
        [entry] = await queue.put([trajectory_pb2.PromptTask(uid="poison", n=1)])
        await queue.dead_letter(
            entry, trajectory_pb2.PromptTask(uid="poison", n=1).SerializeToString(), "test: poison", 2
        )
        depths = api.get("/api/v1/queues").json()
        assert depths["prompts"]["length"] == before and depths["dead_letters"]["length"] == 1
        [dead] = api.get("/api/v1/dead-letters").json()["dead_letters"]
        assert (dead["queue"], dead["reason"], dead["deliveries"]) == ("prompts", "test: poison", 2)
        assert api.post("/api/v1/dead-letters/1-1/replay").status_code == 404
        r = api.post(f"/api/v1/dead-letters/{dead['id']}/replay")
        assert r.status_code == 200, r.text
        depths = api.get("/api/v1/queues").json()
        assert depths["prompts"]["length"] == before + 1 and depths["dead_letters"]["length"] == 0
        assert (
            api.get("/api/v1/audit", params={"limit": 1}).json()["entries"][0]["action"]
            == "replay_dead_letter"
        )
    finally:
        await redis.aclose()


def test_the_webhook_does_nothing_while_automatic_responses_are_off(api):
    body = {"alerts": [{"status": "firing", "labels": {"alertname": "RlmeshKLHigh"}}], "extra": 1}
    assert api.post("/api/v1/alerts/webhook", json=body).json() == {
        "enabled": False,
        "firing": ["RlmeshKLHigh"],
        "actions": [],
    }


async def test_automatic_responses_go_through_the_learner_and_the_audit_log(stack):
    cfg = load_config(str(CPU_DEMO), [*stack.overrides, "rlmesh.control.auto.enabled=true"])
    plane = ControlPlane(cfg)
    try:
        before = (await plane.hyperparams())["values"]["actor_lr"]
        [remedy] = await plane.respond(7, {"actor/grad_norm": 12.0})
        assert remedy.new == pytest.approx(before * 0.5)
        assert (await plane.hyperparams())["values"]["actor_lr"] == pytest.approx(before * 0.5)
        assert await plane.respond(8, {"actor/grad_norm": 12.0}) == []  # rate-limited
        remedy = await plane.respond_to_alert("RlmeshKLHigh")
        assert remedy is not None and remedy.hparam in ("kl_coef", "kl_loss_coef")
        entries = await plane.audit.entries(2)
        assert [(e["who"], e["source"]) for e in entries] == [("auto", "webhook"), ("auto", "auto")]
        assert "grad_norm_high" in entries[1]["detail"]
    finally:
        await plane.close()


def test_metrics_count_requests_by_route(stack):
    text = httpx.get(f"{stack.url}/metrics").text
    assert 'route="/api/v1/hyperparams"' in text and "rlmesh_control_requests_total" in text
    port = stack.control.metrics_port
    assert "rlmesh_control_requests_total" in httpx.get(f"http://127.0.0.1:{port}/metrics").text


def test_rlmesh_ctl_drives_the_same_api_with_the_token_from_the_environment(stack):
    def ctl(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "rlmesh.cli", "ctl", *args],
            env=child_env(RLMESH_CONTROL_URL=stack.url, **env),
            capture_output=True,
            text=True,
            timeout=60,
        )

    out = ctl("--json", "set", "entropy_coeff=0.002", RLMESH_AUTH_TOKEN=TOKEN)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["values"]["entropy_coeff"] == 0.002
    out = ctl("status", RLMESH_AUTH_TOKEN=TOKEN)
    assert out.returncode == 0 and f"run {stack.run_id}: step 0/" in out.stdout, out.stderr
    out = ctl("audit", "--limit", "1", RLMESH_AUTH_TOKEN=TOKEN)
    assert "set_hyperparam entropy_coeff: 0.0 -> 0.002" in out.stdout and "@" in out.stdout, out.stdout
    out = ctl("set", "top_p=7", RLMESH_AUTH_TOKEN=TOKEN)
    assert out.returncode == 1 and "422" in out.stderr and "top_p" in out.stderr
    out = ctl("status")  # no token
    assert out.returncode == 1 and "401" in out.stderr


def test_stop_ends_the_learner_cleanly_and_sigterm_the_control_plane(api, stack):
    r = api.post("/api/v1/run/stop", json={"checkpoint": True})
    assert r.status_code == 200, r.text
    assert stack.learner.process.popen.wait(timeout=60) == 0
    assert api.get("/api/v1/run/status").status_code == 503  # the learner is gone: not a 500
    stack.control.process.popen.send_signal(signal.SIGTERM)
    assert stack.control.process.popen.wait(timeout=30) == 0
