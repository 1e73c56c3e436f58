"""The process launcher with real redis-server and real service processes."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlmesh.runtime.health import grpc_health, redis_ping
from rlmesh.runtime.launcher import LaunchError, ProcessLauncher, ServiceRequest
from tests.support.polling import wait_until
from tests.support.processes import child_env, kill_and_wait_for_children, pid_alive, program
from tests.support.repo import REPO

FREE_REWARD_PORTS = ["rlmesh.reward.port=0", "rlmesh.reward.metrics_port=0"]


def test_private_redis_answers_and_is_gone_after_exit(tmp_path):
    with ProcessLauncher(tmp_path) as launcher:
        redis = launcher.start_redis()
        assert redis_ping(redis.host, redis.port)
        assert (redis.data_dir).is_dir()
        pid = redis.process.pid
    assert not pid_alive(pid)
    assert not redis_ping(redis.host, redis.port)


def test_a_child_that_dies_during_start_up_is_named_with_its_log(tmp_path):
    with ProcessLauncher(tmp_path) as launcher:
        with pytest.raises(LaunchError) as err:
            launcher.start_service(
                "crashy",
                argv_prefix=[sys.executable, "-c", "import sys; print('boom: bad things'); sys.exit(3)"],
            )
        msg = str(err.value)
        assert "crashy" in msg and "exited with code 3" in msg and "boom: bad things" in msg


def test_failure_in_the_middle_of_start_up_leaves_no_child_alive(tmp_path):
    proc = subprocess.run(
        program("launcher_process", "fail", tmp_path),
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode != 0, "start-up should have failed"
    pids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "reference" in pids["error"] and "rlmesh.reference.port" in pids["error"]
    for name in ("redis", "reward", "reference"):
        assert not pid_alive(pids[name]), f"{name} (pid {pids[name]}) outlived the failed start-up"


def test_sigkilled_launcher_leaves_no_orphan(tmp_path):
    proc = subprocess.Popen(
        program("launcher_process", "hold", tmp_path),
        cwd=REPO,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line, "the launcher process printed nothing"
    pids = json.loads(line)
    assert all(pid_alive(p) for p in pids.values())
    kill_and_wait_for_children(proc, pids, "after its parent died")


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path):
    with ProcessLauncher(tmp_path, stop_grace_s=1) as launcher:
        stubborn = launcher.spawn(
            "stubborn",
            [
                sys.executable,
                "-c",
                "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(600)",
            ],
        )
        wait_until(lambda: "ready" in stubborn.log_tail(), 30, "the stubborn child to start")
        code = launcher.stop(stubborn)
    assert code == -signal.SIGKILL
    assert not pid_alive(stubborn.pid)


def test_start_service_waits_for_health(tmp_path):
    with ProcessLauncher(tmp_path) as launcher:
        svc = launcher.start_service(
            "reward", overrides=["rlmesh.reward.port=0", "rlmesh.reward.metrics_port=0"]
        )
        assert grpc_health(svc.grpc_address) == "SERVING"
        assert svc.metrics_port
        pid = svc.process.pid
        code = launcher.stop(svc.process)
    assert code == 0, "a service must exit 0 on SIGTERM"
    assert not pid_alive(pid)


def test_secret_overrides_reach_the_child_but_not_its_argv_or_any_log(tmp_path, caplog):
    import grpc

    from rlmesh.runtime.auth import bearer_metadata
    from rlmesh.v1 import common_pb2, reward_pb2_grpc

    token = "tok-7f3a9c-never-shown"
    caplog.set_level("INFO", logger="rlmesh.launcher")
    with ProcessLauncher(tmp_path) as launcher:
        svc = launcher.start_service(
            "reward",
            overrides=["rlmesh.reward.port=0", "rlmesh.reward.metrics_port=0", f"rlmesh.auth_token={token}"],
        )
        cmdline = Path(f"/proc/{svc.process.pid}/cmdline").read_bytes().decode()
        assert "rlmesh.reward.port=0" in cmdline and token not in cmdline
        # The token still reached the service: calls without it are refused, with it served.
        with grpc.insecure_channel(svc.grpc_address) as ch:
            stub = reward_pb2_grpc.RewardStub(ch)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetInfo(common_pb2.Empty(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.GetInfo(common_pb2.Empty(), timeout=10, metadata=bearer_metadata(token))
        launcher.stop(svc.process)
        service_log = svc.process.log_path.read_text()
    assert "started reward" in caplog.text and token not in caplog.text
    assert token not in service_log


def test_a_service_runs_on_the_cores_its_cpus_key_names(tmp_path):
    core = max(os.sched_getaffinity(0))
    with ProcessLauncher(tmp_path) as launcher:
        svc = launcher.start_service(
            "reward",
            overrides=["rlmesh.reward.port=0", "rlmesh.reward.metrics_port=0", f"rlmesh.reward.cpus={core}"],
        )
        assert os.sched_getaffinity(svc.process.pid) == {core}
        launcher.stop(svc.process)


def test_a_service_given_cores_it_cannot_use_exits_2_naming_the_key(tmp_path):
    with ProcessLauncher(tmp_path) as launcher:
        with pytest.raises(LaunchError, match="exited with code 2") as failed:
            launcher.start_service(
                "reward",
                overrides=["rlmesh.reward.port=0", "rlmesh.reward.metrics_port=0", "rlmesh.reward.cpus=4096"],
                timeout_s=60,
            )
        assert "rlmesh.reward.cpus='4096'" in failed.value.log_path.read_text()


def test_a_service_starts_the_moment_the_one_whose_address_it_needs_serves(tmp_path):
    started = []

    def then(instance):
        started.append(instance.name)
        if instance.name != "first":
            return []
        # It needs the first one's address: it can only be asked for once that one serves.
        assert grpc_health(instance.grpc_address) == "SERVING"
        address = f"rlmesh.reward.addresses=['{instance.grpc_address}']"
        return [ServiceRequest("reward", name="second", overrides=[*FREE_REWARD_PORTS, address])]

    with ProcessLauncher(tmp_path) as launcher:
        first, second = launcher.start_services(
            [ServiceRequest("reward", name="first", overrides=FREE_REWARD_PORTS)], then=then
        )
        assert (first.name, second.name) == ("first", "second") and started == ["first", "second"]
        assert grpc_health(second.grpc_address) == "SERVING"
        cmdline = Path(f"/proc/{second.process.pid}/cmdline").read_bytes().decode()
        assert f"rlmesh.reward.addresses=['{first.grpc_address}']" in cmdline


def test_a_service_that_dies_after_its_dependents_started_fails_the_start_naming_it(tmp_path):
    def then(instance):
        return [ServiceRequest("crashy", name="dependent", argv_prefix=[sys.executable, "-c", "exit(4)"])]

    failed = r"dependent \(pid \d+\) exited with code 4 during start-up"
    with ProcessLauncher(tmp_path) as launcher, pytest.raises(LaunchError, match=failed):
        launcher.start_services([ServiceRequest("reward", overrides=FREE_REWARD_PORTS)], then=then)


# On SIGTERM: says so in a file, then exits once its peer got SIGTERM too (exit 1 if that never
# comes): both exit 0 only when both were signalled before either was waited for.
WAITS_FOR_PEER = """
import pathlib, signal, sys, time
me, peer = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def on_term(signum, frame):
    me.write_text("TERM")
    deadline = time.monotonic() + 60
    while not peer.exists():
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.05)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_stop_together_signals_every_process_before_waiting_for_any(tmp_path):
    a, b = tmp_path / "a.term", tmp_path / "b.term"
    seen_meanwhile = []
    with ProcessLauncher(tmp_path, stop_grace_s=120) as launcher:
        procs = [
            launcher.spawn(name, [sys.executable, "-c", WAITS_FOR_PEER, str(me), str(peer)])
            for name, me, peer in (("a", a, b), ("b", b, a))
        ]
        for proc in procs:
            wait_until(lambda proc=proc: "ready" in proc.log_tail(), 30, f"{proc.name} to start")
        launcher.stop_together(procs, meanwhile=lambda: seen_meanwhile.append(launcher.processes[:]))
        assert [p.popen.returncode for p in procs] == [0, 0], [p.log_tail() for p in procs]
        assert launcher.processes == []  # stopped: stop_all has nothing left to signal
    assert seen_meanwhile == [procs]  # it ran once, while they were still this launcher's
