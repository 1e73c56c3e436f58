"""A learner of one rank joins a process group that listens on loopback only: nothing of it is
reachable from another host (a tcp:// rendezvous's store would listen on every interface)."""

import json
import subprocess
import sys

from tests.support.processes import child_env

PROGRAM = """
import json, psutil, torch, torch.distributed as dist
from rlmesh.learner.dist import init_distributed, shutdown_distributed
init_distributed(device="cpu")
t = torch.ones(2)
dist.all_reduce(t)
listening = [c.laddr.ip for c in psutil.Process().net_connections() if c.status == psutil.CONN_LISTEN]
print(json.dumps({"sum": t.tolist(), "listening": listening}))
shutdown_distributed()
"""


def test_a_single_rank_learner_group_listens_on_loopback_only():
    env = {k: v for k, v in child_env().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["sum"] == [1.0, 1.0]
    assert found["listening"], "gloo listens somewhere: the check would see it"
    assert all(ip in ("127.0.0.1", "::1") for ip in found["listening"]), found["listening"]
