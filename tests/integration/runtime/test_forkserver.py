"""The fork server with real service processes: a forked service is what exec would have started
(its command in ps, its own session, environment and log, its exit code), dies with whoever asked
for it, and anything the server cannot start the same way is exec'd instead."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlmesh.runtime.forkserver import SOCKET_ENV, ForkedChild
from rlmesh.runtime.health import grpc_health
from rlmesh.runtime.launcher import ProcessLauncher, start_fork_server
from tests.support.polling import wait_until
from tests.support.processes import child_env, kill_and_wait_for_children, pid_alive, program
from tests.support.repo import REPO

FREE_REWARD_PORTS = ["rlmesh.reward.port=0", "rlmesh.reward.metrics_port=0"]


@pytest.fixture(scope="module")
def forkserver():
    server = start_fork_server()
    yield server
    server.close()


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def test_a_forked_service_is_what_exec_would_have_started(forkserver, tmp_path):
    import grpc

    from rlmesh.runtime.auth import bearer_metadata
    from rlmesh.v1 import common_pb2, reward_pb2_grpc

    token = "tok-fork-5d1"
    with ProcessLauncher(tmp_path, forkserver=forkserver) as launcher:
        svc = launcher.start_service("reward", overrides=[*FREE_REWARD_PORTS, f"rlmesh.auth_token={token}"])
        proc = svc.process
        assert isinstance(proc.popen, ForkedChild)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert "-m rlmesh.cli serve reward --ready-file" in cmdline and "rlmesh.reward.port=0" in cmdline
        assert token not in cmdline
        assert os.getsid(proc.pid) == proc.pid  # its own session: the launcher signals its group
        assert forkserver.children() == {proc.pid: os.getpid()}
        # Its environment is the launcher's, secrets included: calls without the token are refused.
        with grpc.insecure_channel(svc.grpc_address) as ch:
            stub = reward_pb2_grpc.RewardStub(ch)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetInfo(common_pb2.Empty(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.GetInfo(common_pb2.Empty(), timeout=10, metadata=bearer_metadata(token))
        assert '"msg": "serving"' in proc.log_path.read_text()  # its output went to its own log
        assert launcher.stop(proc) == 0  # SIGTERM, exit code relayed
    assert not pid_alive(proc.pid)
    assert forkserver.children() == {}


def test_exit_codes_and_signals_come_back_as_popen_gives_them(forkserver, tmp_path):
    with ProcessLauncher(tmp_path, forkserver=forkserver) as launcher:
        bad = launcher.spawn("bad", [*launcher_argv("serve", "reward"), "rlmesh.reward.port=not-a-port"])
        assert isinstance(bad.popen, ForkedChild)
        assert bad.popen.wait(timeout=60) == 2
        assert "rlmesh.reward.port" in bad.log_tail()
        svc = launcher.start_service("reward", overrides=FREE_REWARD_PORTS)
        with pytest.raises(subprocess.TimeoutExpired):
            svc.process.popen.wait(timeout=0.1)
        os.kill(svc.process.pid, signal.SIGKILL)
        assert svc.process.popen.wait(timeout=30) == -signal.SIGKILL
        assert svc.process.popen.poll() == -signal.SIGKILL


def test_a_child_whose_import_time_environment_differs_is_execd(forkserver, tmp_path):
    with ProcessLauncher(tmp_path, forkserver=forkserver) as launcher:
        svc = launcher.start_service("reward", overrides=FREE_REWARD_PORTS, env={"OMP_NUM_THREADS": "2"})
        assert isinstance(svc.process.popen, subprocess.Popen)
        assert environ(svc.process.pid)["OMP_NUM_THREADS"] == "2"  # exec'd: its block is its own
        assert grpc_health(svc.grpc_address) == "SERVING"


def test_a_sigkilled_launcher_takes_its_forked_children_with_it(forkserver, tmp_path):
    """A launcher in another process (a replica's, starting its engine) that reached the server
    through the environment: killed, its children go, as their parent-death signal would make them."""
    proc = subprocess.Popen(
        program("launcher_process", "hold", tmp_path),
        cwd=REPO,
        env={**child_env(), SOCKET_ENV: forkserver.socket_path},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = json.loads(proc.stdout.readline())
    assert forkserver.children()[pids["reward"]] == proc.pid  # forked for it, not exec'd
    kill_and_wait_for_children(proc, pids, "with its launcher")


def test_children_stop_with_the_server_and_say_so(tmp_path):
    server = start_fork_server()
    try:
        with ProcessLauncher(tmp_path, forkserver=server) as launcher:
            svc = launcher.start_service("reward", overrides=FREE_REWARD_PORTS)
            assert isinstance(svc.process.popen, ForkedChild)
            server.process.kill()
            assert svc.process.popen.wait(timeout=60) == -signal.SIGTERM
            wait_until(lambda: not pid_alive(svc.process.pid), 60, "the child to exit with its server")
            # Now unreachable: the next child is exec'd.
            again = launcher.start_service("reward", name="again", overrides=FREE_REWARD_PORTS)
            assert isinstance(again.process.popen, subprocess.Popen)
    finally:
        server.close()


def launcher_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlmesh.cli", *args]
