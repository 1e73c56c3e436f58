"""A real Ray cluster of two nodes on this machine, each a ``ray start --block`` process of its own
(own temp dir, ports, custom resource), stopped by pid: no ``ray stop``, which stops every node."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.polling import wait_until
from tests.support.processes import child_env, pid_alive
from tests.support.repo import REPO

RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    from rlmesh.runtime.net import free_port

    return free_port()


@dataclass
class RayNode:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class RayCluster:
    root: Path  # short: Ray's socket paths must fit in 107 bytes
    address: str = ""
    nodes: list[RayNode] = field(default_factory=list)

    def start_node(self, name: str, args: list[str], timeout_s: float = 120) -> RayNode:
        log = self.root / f"{name}.log"
        argv = [
            RAY,
            "start",
            "--block",
            "--disable-usage-stats",
            # No --node-ip-address: Ray turns 127.0.0.1 into this machine's own address on Linux
            # (services.resolve_ip_for_localhost), so the nodes talk over that local address.
            f"--dashboard-agent-listen-port={_free_port()}",
            "--object-store-memory=100000000",
            *args,
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=child_env(RAY_USAGE_STATS_ENABLED="0"),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped as one
            )
        node = RayNode(name, proc, log)
        self.nodes.append(node)

        def started() -> bool:
            assert proc.poll() is None, f"ray start ({name}) exited with {proc.returncode}:\n{node.tail()}"
            return "Ray runtime started" in log.read_text(errors="replace")

        wait_until(started, timeout_s, f"Ray node {name} to start (its log: {log})")
        return node

    def pids(self) -> list[int]:
        """Every live process of the nodes: in the session of a node's ``ray start`` (Ray's agents
        rename themselves, ``ray::DashboardAgent``), or with this cluster's directory in its
        command line (workers)."""
        found = []
        needle = str(self.root).encode()
        sessions = {node.proc.pid for node in self.nodes}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                session = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])
                ours = session in sessions or needle in (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if ours and pid_alive(int(entry.name)):
                found.append(int(entry.name))
        return found

    def stop(self) -> list[int]:
        """SIGTERM to each node's ``ray start`` (it stops its node), then SIGKILL to whatever of its
        process group is left; returns the pids still alive after (should be none)."""
        for node in reversed(self.nodes):
            if node.proc.poll() is None:
                os.killpg(node.proc.pid, signal.SIGTERM)
        for node in reversed(self.nodes):
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=60)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait()
        try:
            wait_until(lambda: not self.pids(), 30, "every process of the Ray cluster to exit")
        except AssertionError:
            left = self.pids()
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return left
        return []


def start_cluster() -> RayCluster:
    """A head (2 CPUs, resource ``head``) and a second node (1 CPU, resource ``node2``)."""
    cluster = RayCluster(Path(tempfile.mkdtemp(prefix="rlray", dir="/tmp")))
    try:
        port = _free_port()
        cluster.start_node(
            "head",
            [
                "--head",
                f"--port={port}",
                "--num-cpus=2",
                "--num-gpus=0",
                '--resources={"head": 1}',
                "--include-dashboard=false",
                f"--ray-client-server-port={_free_port()}",
                f"--temp-dir={cluster.root / 'head'}",
            ],
        )
        cluster.address = f"127.0.0.1:{port}"
        cluster.start_node(
            "node2",
            [
                f"--address={cluster.address}",
                "--num-cpus=1",
                "--num-gpus=0",
                '--resources={"node2": 1}',
                f"--temp-dir={cluster.root / 'node2'}",
            ],
        )
    except BaseException:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
        raise
    return cluster
