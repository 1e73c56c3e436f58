"""The control plane and the learner behind it over TLS (rlmesh.security.tls from the environment,
as a process exports it to its children): the REST API answers over HTTPS to a client that trusts
the run's CA and reaches the learner over TLS gRPC; plain HTTP gets no answer; `rlmesh ctl` finds
its way with the same environment."""

import subprocess
import sys

import httpx
import pytest

from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.tls import TlsFiles, export_tls
from tests.support.control import AUTH, TOKEN, start_control_stack
from tests.support.processes import child_env
from tests.support.repo import REPO
from tests.support.tls import make_tls_files


def test_the_control_plane_serves_https_and_calls_the_learner_over_tls(tmp_path, monkeypatch):
    made = make_tls_files(tmp_path / "tls")
    tls = TlsFiles(str(made.cert_file), str(made.key_file), str(made.ca_file))
    env: dict[str, str] = {}
    export_tls(tls, env)
    for name, value in env.items():  # the launcher's probes and every child speak TLS
        monkeypatch.setenv(name, value)
    with ProcessLauncher(tmp_path / "procs", stop_grace_s=20) as launcher:
        stack = start_control_stack(launcher, tmp_path / "stack")
        url = f"https://{stack.control.grpc_address}"
        status = httpx.get(f"{url}/api/v1/run/status", headers=AUTH, verify=tls.ca_file, timeout=60)
        assert status.status_code == 200, status.text
        assert status.json()["run_id"] == stack.run_id  # the plane reached the learner over TLS
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(f"http://{stack.control.grpc_address}/health", timeout=30)
        ctl = subprocess.run(
            [sys.executable, "-m", "rlmesh.cli", "ctl", "--url", url, "status"],
            env={**child_env(), **env, "RLMESH_AUTH_TOKEN": TOKEN},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert ctl.returncode == 0, ctl.stderr
        assert stack.run_id in ctl.stdout
