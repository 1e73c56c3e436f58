"""`rlmesh up` as a user runs it: Redis and every service started healthy, then all stopped."""

import re

from tests.integration.cli.test_cli import rlmesh
from tests.support.processes import pid_alive
from tests.support.repo import REPO


def test_up_starts_redis_and_every_service_healthy_then_stops_them_all():
    out = rlmesh("up", "rlmesh.log_format=text")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PING: PONG" in out.stdout
    pids = []
    for name in ("reward", "reference", "rollout-0", "learner", "control"):
        line = next(
            (
                ln
                for ln in out.stdout.splitlines()
                if ln.startswith(f"[rlmesh up] {name} ") and "health:" in ln
            ),
            None,
        )
        assert line, f"no status line for {name}:\n{out.stdout}"
        assert "health: SERVING" in line and "rlmesh series" in line, line
        pids.append(int(re.search(r"pid (\d+)", line).group(1)))
    pids.append(int(re.search(r"redis\s+pid (\d+)", out.stdout).group(1)))
    assert "all processes stopped" in out.stdout
    assert not any(pid_alive(p) for p in pids)
    # A check, not a run: the learner held before its first step (rlmesh.learner.start_paused)
    # instead of training the check's tiny data with the default batch shape.
    logs = REPO / re.search(r"logs in (\S+)", out.stdout)[1]
    learner_log = (logs / "learner.log").read_text()
    tail = learner_log[-2000:]
    assert "training failed" not in learner_log and "[learner] step 1:" not in learner_log, tail
