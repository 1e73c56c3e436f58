"""``ServiceShell``: the body of every rlmesh Ray actor. It runs one service (``rlmesh serve`` or a
redis-server) as its child process on the actor's node and reports on it; no service logic here."""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlmesh.job.train import MetricsFollower
from rlmesh.runtime.launcher import ManagedProcess, ProcessLauncher, restartable

log = logging.getLogger("rlmesh.ray")


@dataclass(frozen=True)
class ShellSpec:
    """What one actor runs: everything it needs travels with it, the config file's text included,
    so a node needs the code and the data the config names, nothing from the driver's disk."""

    service: str  # redis, reward, reference, rollout, learner
    name: str  # its name in logs and in the run (rollout-0)
    workdir: str  # logs (and Redis data) go to <workdir>/logs on the actor's node
    config_text: str | None = None
    overrides: tuple[str, ...] = ()
    cwd: str = ""  # the driver's: relative paths in the config resolve there when the node has it
    health_timeout_s: float = 600.0
    stop_grace_s: float = 30.0
    # Which exits of the child end the actor, for Ray to restart it: "exit" any (a replica that lost
    # its engine exits 3), "death" only a death (``restartable``: a learner killed, or a rank of it
    # lost; one that finished or failed by itself stays, its exit code the run's), "" none.
    restart_on: Literal["", "exit", "death"] = ""
    env: dict[str, str] = field(default_factory=dict)


def node_overrides(service: str, node_ip: str) -> list[str]:
    """Where a service listens on its node: the node's address (what other nodes reach), free
    ports (it reports them), and for the learner the address engines join its weight group at."""
    found = [
        f"rlmesh.{service}.host={node_ip}",
        f"rlmesh.{service}.port=0",
        f"rlmesh.{service}.metrics_port=0",
    ]
    if service == "learner":
        found.append(f"rlmesh.weight_sync.master_address={node_ip}")
    return found


def ends_actor(restart_on: str, code: int | None) -> bool:
    """Whether the child's exit with ``code`` ends its actor under ``ShellSpec.restart_on``."""
    if restart_on == "death":
        return restartable(code)
    return restart_on == "exit"


class ServiceShell:
    """Starts its service in ``__init__`` (Ray's constructor: it returns once the service is
    healthy, or fails the actor with the service's log), then answers ``status`` and ``stop``.

    Ray runs a plain actor's methods on the worker's main thread, the thread that started the child:
    the child's parent-death signal (``ProcessLauncher``) fires when this worker dies, however it
    dies, so a killed actor leaves no service behind. With ``restart_on`` a child that exits on its
    own (a replica whose engine was lost exits 3; a learner only when it died) takes the worker
    down with it, which Ray counts as a death and answers with a restart, up to the actor's
    ``max_restarts``: the new actor's constructor starts the service again, on new ports."""

    def __init__(self, spec: ShellSpec) -> None:
        import ray

        context = ray.get_runtime_context()
        self.spec = spec
        self.node_id: str = context.get_node_id()
        # The address the node joined the cluster with: what the other nodes reach it at.
        self.node_ip: str = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == self.node_id)
        self.restarted: bool = bool(context.was_current_actor_reconstructed)
        self.resources: dict[str, float] = dict(context.get_assigned_resources())
        self.stopping = False
        if spec.cwd and os.path.isdir(spec.cwd):
            os.chdir(spec.cwd)  # this worker runs this actor alone: the change is its own
        os.environ.update(spec.env)
        workdir = Path(spec.workdir)
        self.launcher = ProcessLauncher(workdir, stop_grace_s=spec.stop_grace_s)
        self.address = ""
        self.metrics_port: int | None = None
        self.follower: MetricsFollower | None = None
        self.earlier_rows: list[dict[str, float]] = []  # a dead predecessor's, not yet handed out
        try:
            self.process = self._start(workdir)
        except BaseException:
            self.launcher.stop_all()
            raise
        if spec.restart_on:
            threading.Thread(target=self._exit_with_child, daemon=True, name="child-watch").start()

    def _start(self, workdir: Path, extra: Sequence[str] = ()) -> ManagedProcess:
        spec = self.spec
        if spec.service == "redis":
            # Other nodes reach it on the node's address, where a Redis without a password is in
            # protected mode (it answers DENIED to all but loopback): a password per run, which
            # reaches the services as a secret override (rlmesh.config.secrets), never their argv.
            redis = self.launcher.start_redis(host=self.node_ip, password=secrets.token_urlsafe(18))
            self.address = redis.url
            return redis.process
        config_path = None
        if spec.config_text is not None:
            config_path = workdir / f"{spec.name}.config.yaml"
            # It may hold the token: readable by this user only.
            with open(os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(spec.config_text)
        overrides = [*spec.overrides, *node_overrides(spec.service, self.node_ip), *extra]
        if spec.service == "learner":
            from rlmesh.config import load_config

            cfg = load_config(str(config_path) if config_path else None, overrides)
            # Only rows from here on: a resumed run appends to the same file. A restarted shell also
            # hands out the rows its dead learner wrote after the driver's last call.
            self.follower = MetricsFollower(
                Path(cfg.trainer.default_local_dir).expanduser() / "metrics.jsonl"
            )
            if self.restarted:
                self.earlier_rows = self._unread_rows(self.follower)
            self._save_offset()
        instance = self.launcher.start_service(
            spec.service,
            name=spec.name,
            config_path=config_path,
            overrides=overrides,
            timeout_s=spec.health_timeout_s,
        )
        self.address, self.metrics_port = instance.grpc_address, instance.metrics_port
        return instance.process

    def _offset_path(self) -> Path:
        """Where the learner's rows no call has returned begin, kept on the node across restarts."""
        return Path(self.spec.workdir) / f"{self.spec.name}.metrics-offset"

    def _save_offset(self) -> None:
        if self.follower is not None:
            self._offset_path().write_text(str(self.follower.offset))

    def _unread_rows(self, follower: MetricsFollower) -> list[dict[str, float]]:
        """The rows from the saved offset up to the end: the dead learner's last (none is written
        now, before the new learner starts); ``follower`` then goes on after them. None on a node
        where the previous incarnation did not run."""
        try:
            start = int(self._offset_path().read_text())
        except (FileNotFoundError, ValueError):
            return []
        if start > follower.offset:  # not this file's offset
            return []
        follower.offset = start
        return follower.new_rows()

    def _exit_with_child(self) -> None:
        code = self.process.popen.wait()
        if self.stopping or not ends_actor(self.spec.restart_on, code):
            return  # a learner that finished or failed: ``status`` reports its exit code
        print(
            f"{self.spec.name} (pid {self.process.pid}) exited with code {code}: ending its actor "
            f"so that Ray restarts it; its log: {self.process.log_path}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)  # an unexpected worker death: what Ray restarts (exit_actor() would be final)

    def status(self, rows: bool = True) -> dict[str, Any]:
        """Where it runs and how its service is: the driver polls this; ``rows`` are the learner's
        metrics rows new since the last call that asked for them (only the driver asks), and, once,
        ``earlier_rows`` those its dead predecessor wrote that no call returned."""
        new: list[dict[str, float]] = []
        earlier: list[dict[str, float]] = []
        if self.follower is not None and rows:
            new, earlier, self.earlier_rows = self.follower.new_rows(), self.earlier_rows, []
            if new:
                self._save_offset()
        return {
            "name": self.spec.name,
            "service": self.spec.service,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "actor_pid": os.getpid(),
            "pid": self.process.pid,
            "address": self.address,
            "metrics_port": self.metrics_port,
            "restarted": self.restarted,
            "resources": self.resources,
            "exit_code": self.process.popen.poll(),
            "stopped": self.stopping,
            "log": str(self.process.log_path),
            "rows": new,
            "earlier_rows": earlier,
        }

    def repoint(self, learner_address: str) -> dict[str, Any]:
        """The control plane's service, started again on its port (its URL stays) and pointed at
        ``learner_address``: where Ray restarted the learner, on any node; its status after."""
        if self.spec.service != "control":
            raise ValueError(f"{self.spec.name} is no control plane: only that one follows the learner")
        port = self.address.rsplit(":", 1)[1]
        self.launcher.stop(self.process)
        self.process = self._start(
            Path(self.spec.workdir),
            [f"rlmesh.learner.addresses=['{learner_address}']", f"rlmesh.control.port={port}"],
        )
        return self.status(rows=False)

    def log_tail(self, lines: int = 20) -> str:
        return self.process.log_tail(lines)

    def stop(self) -> int | None:
        """SIGTERM to the service (SIGKILL after the grace), then whatever it started; its exit code."""
        self.stopping = True
        code = self.launcher.stop(self.process)
        self.launcher.stop_all()
        return code
