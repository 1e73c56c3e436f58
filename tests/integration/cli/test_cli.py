"""The `rlmesh` command as a user runs it."""

import re
import signal
import subprocess
import sys

from rlmesh.runtime.health import redis_ping
from tests.support.processes import child_env
from tests.support.repo import REPO


def rlmesh(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_the_subcommands():
    out = rlmesh("--help")
    assert out.returncode == 0
    for command in (
        "serve",
        "up",
        "redis",
        "config",
        "health",
        "protos",
        "data",
        "engine",
        "demo",
        "sft",
        "export",
        "ctl",
    ):
        assert re.search(rf"^\s+{command}\s", out.stdout, re.M), f"{command} missing from --help"


def test_serve_unknown_service_lists_the_known_ones():
    out = rlmesh("serve", "nope")
    assert out.returncode == 2
    assert "unknown service 'nope'" in out.stderr
    for name in ("learner", "reference", "reward", "rollout", "control"):
        assert name in out.stderr


def test_serve_with_a_bad_override_exits_2_naming_the_key():
    out = rlmesh("serve", "reward", "rlmesh.reward.prot=1")
    assert out.returncode == 2
    assert "rlmesh.reward.prot" in out.stderr and "rlmesh.reward.port" in out.stderr


def test_redis_runs_with_a_password_it_never_prints(tmp_path):
    """`rlmesh redis`: a generated password in a 0600 file, the URL it prints masked; with env
    RLMESH_REDIS_PASSWORD that one."""
    env = {k: v for k, v in child_env().items() if k != "RLMESH_REDIS_PASSWORD"}
    for given in (None, "given-pw"):
        workdir = tmp_path / ("from-env" if given else "generated")
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlmesh.cli", "redis", "--dir", str(workdir), "--no-aof"],
            env=env | ({"RLMESH_REDIS_PASSWORD": given} if given else {}),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stdout.readline()
            url = re.search(r"redis ready at (\S+)", line).group(1)
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            assert url == f"redis://:***@127.0.0.1:{port}/0", line
            if given is None:
                path = workdir / "redis" / "password"
                assert path.stat().st_mode & 0o077 == 0
                password = path.read_text().strip()
            else:
                password = given
                assert not (workdir / "redis" / "password").exists()
            assert password not in line
            assert not redis_ping("127.0.0.1", port)
            assert redis_ping("127.0.0.1", port, password=password)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) is not None
