"""Process launcher: a private redis-server and rlmesh services as child processes, never orphaned.

docs/reliability.md#guards-that-keep-a-long-run-bounded"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from urllib.parse import quote, urlencode

from rlmesh.config.secrets import redact_argv, secret_env, split_secret_overrides
from rlmesh.runtime.cpu_env import quiet_deepspeed_on_cpu
from rlmesh.runtime.forkserver import SOCKET_ENV, ForkedChild, ForkServer, cli_args
from rlmesh.runtime.health import grpc_health, http_ok, redis_ping
from rlmesh.runtime.net import bracket, dial_host, free_port, host_of, is_wildcard
from rlmesh.runtime.tls import http_scheme

log = logging.getLogger("rlmesh.launcher")

_PR_SET_PDEATHSIG = 1

# A child's log (workdir/logs/<name>.log, mode 0600) is rotated once it passes LOG_MAX_BYTES:
# checked every LOG_CHECK_S and when a child of that name starts again; LOG_BACKUPS older copies
# (<name>.log.1 newest) are kept.
LOG_MAX_BYTES = 64 << 20
LOG_BACKUPS = 3
LOG_CHECK_S = 5.0
# A service that exits with this code (sysexits' EX_TEMPFAIL) lost a part of itself it cannot do
# without, not to its own fault (the learner: one of its ranks died); starting it again is the cure.
EXIT_RESTART = 75


def restartable(returncode: int | None) -> bool:
    """Whether a service that exited with ``returncode`` died rather than failed: killed by a
    signal (the OOM killer, ``kill -9``), or ``EXIT_RESTART``. A failure it reported itself (exit
    1: an error in its run, 2: its config) would only repeat."""
    return returncode is not None and (returncode < 0 or returncode in (EXIT_RESTART, 128 + 9))


def open_private_log(path: Path) -> int:
    """An append-only descriptor on ``path``, which only its owner can read (logs may quote
    prompts, addresses and errors); an existing file is narrowed to 0600 too."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def rotate_log(path: Path, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS) -> bool:
    """Rotates ``path`` when it is over ``max_bytes``: ``<path>.N`` -> ``<path>.N+1`` (the oldest
    dropped), a copy to ``<path>.1``, then ``path`` truncated in place. Copy and truncate, not
    rename: the child keeps writing through its own descriptor, which O_APPEND puts at the new
    end (lines written between the copy and the truncation are lost). Returns whether it did."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    if backups > 0:
        for n in range(backups - 1, 0, -1):
            older = path.with_name(f"{path.name}.{n}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
        first = path.with_name(f"{path.name}.1")
        first.unlink(missing_ok=True)  # created afresh, so with the mode below
        with open(path, "rb") as src, open(open_private_log(first), "wb") as dst:
            shutil.copyfileobj(src, dst)
    os.truncate(path, 0)
    return True


class LaunchError(RuntimeError):
    """A child failed to start or to become healthy; the message names it and quotes its log.

    ``headline`` is the message's first sentence (which child, what happened) and ``log_path`` its
    log, when a child was started at all: what a one-line report needs."""

    def __init__(self, message: str, *, headline: str = "", log_path: Path | None = None) -> None:
        super().__init__(message)
        self.headline = headline or message
        self.log_path = log_path


# Runs first in every child: asks the kernel to SIGTERM it when the launcher dies, then becomes
# the real program (execvp keeps the setting). A preexec_fn would do the same between fork and
# exec, but that is unsafe in a threaded launcher (gRPC and asyncio run threads) and can deadlock.
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ppid = int(sys.argv[1])\n"
    "try:\n"
    "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except OSError:\n"
    "    pass\n"
    "if os.getppid() != ppid:\n"
    "    sys.exit(1)  # the launcher died before the setting took: do not start orphaned\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def with_parent_death_signal(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that the child gets SIGTERM when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]


def base_child_env() -> dict[str, str]:
    """The environment every child starts from: this process's, one intra-op thread unless set,
    unbuffered output, DeepSpeed's CPU accelerator where there is no GPU."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    quiet_deepspeed_on_cpu(env)
    return env


def start_fork_server(enabled: bool = True) -> ForkServer | None:
    """A fork server for a launcher's children (rlmesh.runtime.fork_server), None when not
    ``enabled``; it imports while the caller goes on."""
    return ForkServer.start(base_child_env()) if enabled else None


@dataclass
class ServiceRequest:
    """One service for :meth:`ProcessLauncher.start_services` (the arguments of ``start_service``)."""

    service: str
    name: str | None = None
    config_path: str | os.PathLike[str] | None = None
    overrides: Sequence[str] = ()
    env: dict[str, str] | None = None
    timeout_s: float = 120.0
    argv_prefix: Sequence[str] | None = None
    also_alive: Sequence[ManagedProcess] = ()


# Called as each service of ``start_services`` is healthy: the services to start now (those that
# needed its address), waited on with the rest.
ThenStart = Callable[["ServiceInstance"], Sequence[ServiceRequest]]


@dataclass
class _Wait:
    """One child ``wait_all_ready`` waits on; its timeout runs from ``since`` (when it was spawned)."""

    proc: ManagedProcess
    ready: Callable[[], bool]
    timeout_s: float
    also_alive: Sequence[ManagedProcess] = ()
    since: float = field(default_factory=time.monotonic)
    request: ServiceRequest | None = None


def _service_ready(proc: ManagedProcess, ready_file: Path) -> bool:
    """Its ready file is written and it answers health: gRPC SERVING, or for an HTTP service (the
    control plane) ``/health`` 200."""
    if not ready_file.exists():
        return False
    proc.info = json.loads(ready_file.read_text())
    if proc.info.get("protocol") == "http":
        return http_ok(f"{http_scheme()}://{dial_address(proc.info)}/health", timeout_s=1.0)
    return grpc_health(dial_address(proc.info), timeout_s=1.0) == "SERVING"


def dial_address(ready: dict) -> str:
    """Where this host reaches a service from its ready file: the address it bound, or, bound to a
    wildcard, the one it advertises (a service in another network namespace has no loopback here)."""
    bound = str(ready["grpc_address"])
    return str(ready.get("advertise_address") or bound) if is_wildcard(host_of(bound)) else bound


def _instance_of(wait: _Wait) -> ServiceInstance:
    assert wait.request is not None
    proc = wait.proc
    metrics_port = proc.info.get("metrics_port")
    return ServiceInstance(
        process=proc,
        name=wait.request.name or wait.request.service,
        grpc_address=dial_address(proc.info),
        metrics_port=int(metrics_port) if metrics_port is not None else None,
    )


def local_rendezvous(world_size: int) -> dict[str, str]:
    """The environment torchrun gives every rank of a one-machine group (RANK/LOCAL_RANK aside)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size)}


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes] | ForkedChild
    log_path: Path
    info: dict[str, object] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` of its log, reaching into the newest rotated copy when the log was
        just rotated."""
        tail: list[str] = []
        for path in (self.log_path, self.log_path.with_name(f"{self.log_path.name}.1")):
            try:
                tail = path.read_text(errors="replace").splitlines()[-(lines - len(tail)) :] + tail
            except OSError:
                continue
            if len(tail) >= lines:
                break
        return "\n".join(tail) if tail else "<no log>"


@dataclass(frozen=True)
class RedisTLS:
    """The files of a TLS-only redis-server: its certificate and key, and the CA that signed them,
    which clients check the server against (and the server clients, with ``verify_clients``; a
    client then presents this same certificate)."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    verify_clients: bool = False

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if self.verify_clients:
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context

    def url_query(self) -> dict[str, str]:
        """The query parameters of a rediss:// URL that connects with these files (redis-py's)."""
        query = {"ssl_ca_certs": str(self.ca_file)}
        if self.verify_clients:
            query |= {"ssl_certfile": str(self.cert_file), "ssl_keyfile": str(self.key_file)}
        return query


@dataclass
class RedisInstance:
    process: ManagedProcess
    host: str
    port: int
    data_dir: Path
    password: str | None = None  # requirepass: the default user's
    tls: RedisTLS | None = None

    @property
    def url(self) -> str:
        """What a client connects with: rediss:// with the CA under TLS, and the password when there
        is one (a secret then: rlmesh.config.secrets keeps it out of argv and logs)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}{self.host}:{self.port}/0?{urlencode(self.tls.url_query())}"
        return f"redis://{auth}{self.host}:{self.port}/0"


@dataclass
class EngineInstance:
    process: ManagedProcess
    url: str


@dataclass
class ServiceInstance:
    process: ManagedProcess
    name: str
    grpc_address: str
    metrics_port: int | None


@dataclass
class LearnerRanks:
    """A data-parallel learner: rank 0 serves gRPC and drives the run, the others follow it."""

    rank0: ServiceInstance
    followers: list[ManagedProcess]

    @property
    def processes(self) -> list[ManagedProcess]:
        return [self.rank0.process, *self.followers]


def _redis_config_quote(value: str) -> str:
    """``value`` as one argument of a redis.conf line (a double-quoted string, escapes and all)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


class ProcessLauncher:
    """Starts children, waits until each is healthy, and stops all of them on the way out."""

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        stop_grace_s: float = 30.0,
        log_max_bytes: int = LOG_MAX_BYTES,
        log_backups: int = LOG_BACKUPS,
        forkserver: ForkServer | None = None,
    ) -> None:
        # ``rlmesh.cli`` children fork from ``forkserver`` (its owner closes it after this launcher
        # stopped them), else from the one this process's own launcher gave it, else exec.
        self.forkserver = forkserver or ForkServer.inherited()
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="rlmesh-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(mode=0o700, exist_ok=True)
        self.stop_grace_s = stop_grace_s
        self.log_max_bytes = log_max_bytes
        self.log_backups = log_backups
        self.processes: list[ManagedProcess] = []
        self._log_watch: threading.Thread | None = None
        self._log_watch_stop = threading.Event()
        self._log_lock = threading.Lock()  # one rotation at a time (the watcher, a spawn)

    def __enter__(self) -> ProcessLauncher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> ManagedProcess:
        """Starts ``argv``; rlmesh config overrides that carry secrets go to the child's
        environment instead (see ``rlmesh.config.secrets``), so ``ps`` and logs never show them."""
        argv, secret = split_secret_overrides(argv)
        log_path = self.workdir / "logs" / f"{name}.log"
        child_env = {**base_child_env(), **(env or {}), **secret_env(secret)}
        args = cli_args(argv) if self.forkserver is not None else None
        if self.forkserver is not None:
            child_env[SOCKET_ENV] = self.forkserver.socket_path
        with self._log_lock:  # a restart under the same name
            rotate_log(log_path, self.log_max_bytes, self.log_backups)
        with open(open_private_log(log_path), "ab") as log_file:
            popen: subprocess.Popen[bytes] | ForkedChild | None = None
            if self.forkserver is not None and args is not None:
                popen = self.forkserver.fork(args, child_env, log_file.fileno())
            if popen is None:
                popen = subprocess.Popen(
                    with_parent_death_signal(argv),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=child_env,
                    start_new_session=True,
                )
        proc = ManagedProcess(name=name, argv=list(argv), popen=popen, log_path=log_path)
        self.processes.append(proc)
        self._watch_logs()
        log.info("started %s (pid %d): %s", name, popen.pid, " ".join(redact_argv(argv)))
        return proc

    def rotate_logs(self) -> list[Path]:
        """Rotates every child's log that is over the size limit (see :func:`rotate_log`); returns
        those it rotated. A thread calls it every ``LOG_CHECK_S`` while children run."""
        paths = {proc.log_path for proc in list(self.processes)}
        with self._log_lock:
            return sorted(p for p in paths if rotate_log(p, self.log_max_bytes, self.log_backups))

    def _watch_logs(self) -> None:
        with self._log_lock:
            if self._log_watch is not None and not self._log_watch_stop.is_set():
                return
            stop = self._log_watch_stop = threading.Event()

            def watch() -> None:
                while not stop.wait(LOG_CHECK_S):
                    try:
                        self.rotate_logs()
                    except OSError as e:  # a full disk, a log removed by hand: try again next time
                        log.warning("could not rotate a child's log: %s", e)

            self._log_watch = threading.Thread(target=watch, name="rlmesh-log-rotation", daemon=True)
            self._log_watch.start()

    def wait_ready(
        self,
        proc: ManagedProcess,
        ready: Callable[[], bool],
        timeout_s: float,
        also_alive: Sequence[ManagedProcess] = (),
    ) -> None:
        """Polls ``ready`` until it holds; fails fast if the child (or one of ``also_alive``, the
        processes its start-up depends on) exits, naming it with its log."""
        self.wait_all_ready([(proc, ready, timeout_s, also_alive)])

    def wait_all_ready(
        self, waits: Sequence[tuple[ManagedProcess, Callable[[], bool], float, Sequence[ManagedProcess]]]
    ) -> None:
        """:meth:`wait_ready` for several children at once, each ``(proc, ready, timeout_s,
        also_alive)``: returns when every one is ready, raises for the first that fails. (One
        polling loop in the calling thread: a child's parent-death signal is tied to the thread
        that spawned it, so children are spawned and waited on here, never in worker threads.)"""
        self._wait_ready(
            [_Wait(proc, ready, timeout_s, also_alive) for proc, ready, timeout_s, also_alive in waits]
        )

    def _wait_ready(
        self, waits: Sequence[_Wait], on_ready: Callable[[_Wait], Sequence[_Wait]] | None = None
    ) -> None:
        """Polls every wait until it is ready; ``on_ready(wait)`` returns the waits of children it
        spawned once ``wait`` was (they join the loop, each timed from its own spawn)."""
        pending = list(waits)
        while pending:
            for wait in list(pending):
                proc = wait.proc
                for p in (proc, *wait.also_alive):
                    if not p.alive():
                        headline = (
                            f"{p.name} (pid {p.pid}) exited with code {p.popen.returncode} during start-up"
                        )
                        raise LaunchError(
                            f"{headline}; last lines of {p.log_path}:\n{p.log_tail()}",
                            headline=headline,
                            log_path=p.log_path,
                        )
                if wait.ready():
                    pending.remove(wait)
                    if on_ready is not None:
                        pending += on_ready(wait)
                elif time.monotonic() - wait.since > wait.timeout_s:
                    headline = f"{proc.name} (pid {proc.pid}) was not healthy within {wait.timeout_s:.0f} s"
                    raise LaunchError(
                        f"{headline}; last lines of {proc.log_path}:\n{proc.log_tail()}",
                        headline=headline,
                        log_path=proc.log_path,
                    )
            if pending:
                time.sleep(0.05)

    def start_redis(
        self,
        *,
        name: str = "redis",
        appendonly: bool = True,
        timeout_s: float = 30.0,
        port: int | None = None,
        password: str | None = None,
        acl_users: Sequence[str] = (),
        tls: RedisTLS | None = None,
        host: str = "127.0.0.1",
        maxmemory: str = "0",
    ) -> RedisInstance:
        """A private redis-server on a free port of ``host`` (loopback by default) with its own data
        dir (AOF on by default).

        ``password``: its requirepass; ``acl_users``: ACL rules, one user each (``"alice on >pw ~*
        +@all"``); both go in a config file only its owner can read, never in its argv. ``tls``:
        it serves TLS only, on ``port``. ``maxmemory`` (``2gb``; ``0`` = none): past it writes fail
        (``noeviction``), as nothing in a run's streams may be dropped to make room."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise LaunchError(
                "redis-server not found on PATH: install it (`apt-get install redis-server`; "
                "`make demo` does this) or point rlmesh.redis_url at a server"
            )
        port = port or free_port()
        data_dir = self.workdir / name
        data_dir.mkdir(exist_ok=True)
        secrets = [f"requirepass {_redis_config_quote(password)}"] if password is not None else []
        secrets += [f"user {rule}" for rule in acl_users]
        config_file = []
        if secrets:
            path = data_dir / "secrets.conf"
            path.unlink(missing_ok=True)  # created afresh, so with the mode below
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write("\n".join(secrets) + "\n")
            config_file = [str(path)]  # redis-server reads a config file first, then the flags
        listen = ["--port", str(port)]
        if tls:
            listen = [
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--tls-cert-file",
                str(tls.cert_file),
                "--tls-key-file",
                str(tls.key_file),
                "--tls-ca-cert-file",
                str(tls.ca_file),
                "--tls-auth-clients",
                "yes" if tls.verify_clients else "no",
            ]
        argv = [
            binary,
            *config_file,
            *listen,
            "--bind",
            host,
            "--dir",
            str(data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if appendonly else "no",
            "--maxmemory",
            maxmemory,
            "--maxmemory-policy",
            "noeviction",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            "",
        ]
        proc = self.spawn(name, argv)
        context = tls.client_context() if tls else None
        # ACL users alone may turn the default user off: any answer then says it serves.
        self.wait_ready(
            proc,
            lambda: redis_ping(host, port, password=password, tls=context, any_reply=bool(acl_users)),
            timeout_s,
        )
        return RedisInstance(
            process=proc, host=host, port=port, data_dir=data_dir, password=password, tls=tls
        )

    def start_service(
        self,
        service: str,
        *,
        name: str | None = None,
        config_path: str | os.PathLike[str] | None = None,
        overrides: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout_s: float = 120.0,
        argv_prefix: Sequence[str] | None = None,
        also_alive: Sequence[ManagedProcess] = (),
    ) -> ServiceInstance:
        """Runs ``rlmesh serve <service>`` and waits for its ready file and gRPC health SERVING
        (an HTTP service's, the control plane's, ``/health`` answering 200), failing fast if it or
        one of ``also_alive`` exits first."""
        [instance] = self.start_services(
            [
                ServiceRequest(
                    service, name, config_path, list(overrides), env, timeout_s, argv_prefix, list(also_alive)
                )
            ]
        )
        return instance

    def start_services(
        self, requests: Sequence[ServiceRequest], then: ThenStart | None = None
    ) -> list[ServiceInstance]:
        """:meth:`start_service` for several services side by side: all are spawned, then waited
        on together; raises for the first that fails (the others keep running until this
        launcher stops them).

        ``then(instance)`` is called (in this thread) as each one is healthy; the services it
        returns are spawned at once and waited on with the rest: a service that needs another's
        address starts the moment that one serves, not when a whole group does. Returns every
        instance, in the order the services were spawned."""
        spawned: list[_Wait] = []
        instances: dict[int, ServiceInstance] = {}

        def spawn_all(batch: Sequence[ServiceRequest]) -> list[_Wait]:
            waits = [self._spawn_service(r) for r in batch]
            spawned.extend(waits)
            return waits

        def on_ready(wait: _Wait) -> list[_Wait]:
            instance = instances[id(wait)] = _instance_of(wait)
            return spawn_all(then(instance)) if then is not None else []

        self._wait_ready(spawn_all(requests), on_ready)
        return [instances[id(wait)] for wait in spawned]

    def _spawn_service(self, r: ServiceRequest) -> _Wait:
        name = r.name or r.service
        ready_file = self.workdir / f"{name}.ready.json"
        ready_file.unlink(missing_ok=True)
        argv = list(r.argv_prefix or [sys.executable, "-m", "rlmesh.cli", "serve", r.service])
        argv += ["--ready-file", str(ready_file)]
        if r.config_path:
            argv += ["--config", str(r.config_path)]
        argv += list(r.overrides)
        proc = self.spawn(name, argv, r.env)
        return _Wait(
            proc,
            functools.partial(_service_ready, proc, ready_file),
            r.timeout_s,
            r.also_alive,
            request=r,
        )

    def start_learner(
        self,
        world_size: int,
        *,
        name: str = "learner",
        config_path: str | os.PathLike[str] | None = None,
        overrides: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> LearnerRanks:
        """Runs ``rlmesh serve learner`` as ``world_size`` data-parallel ranks on this machine, with
        the environment ``torchrun`` would give them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``), and waits until rank 0 serves.

        Rank 0 only serves once every rank has joined the process group, so the followers start
        first; one that exits during start-up fails this at once (rank 0 would wait for it).
        ``stop_all`` stops them after rank 0 (reverse start order): rank 0 finishes its step and
        its final checkpoint with them, then tells them to stop.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        rendezvous = local_rendezvous(world_size)
        argv = [sys.executable, "-m", "rlmesh.cli", "serve", "learner"]
        if config_path:
            argv += ["--config", str(config_path)]
        followers = [
            self.spawn(
                f"{name}-rank{r}",
                [*argv, *overrides],
                {**(env or {}), **rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)},
            )
            for r in range(1, world_size)
        ]
        rank0 = self.start_service(
            "learner",
            name=name,
            config_path=config_path,
            overrides=overrides,
            env={**(env or {}), **rendezvous, "RANK": "0", "LOCAL_RANK": "0"},
            timeout_s=timeout_s,
            also_alive=followers,
        )
        return LearnerRanks(rank0=rank0, followers=followers)

    def start_engine(
        self,
        model_path: str | os.PathLike[str],
        *,
        name: str = "engine",
        host: str = "127.0.0.1",
        port: int = 0,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout_s: float = 180.0,
    ) -> EngineInstance:
        """Runs ``rlmesh engine`` (the embedded engine) on a free port of ``host``; waits until /health
        answers. The URL it returns dials ``host``, or loopback when ``host`` is a wildcard."""
        ready_file = self.workdir / f"{name}.ready.json"
        ready_file.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "rlmesh.cli",
            "engine",
            "--model-path",
            str(model_path),
            "--host",
            host,
            "--port",
            str(port),
            "--ready-file",
            str(ready_file),
            *extra_args,
        ]
        proc = self.spawn(name, argv, env)

        def ready() -> bool:
            if not ready_file.exists():
                return False
            proc.info = json.loads(ready_file.read_text())
            return http_ok(f"{http_scheme()}://{dial}:{proc.info['port']}/health")

        dial = bracket(dial_host(host))
        self.wait_ready(proc, ready, timeout_s)
        return EngineInstance(process=proc, url=f"{http_scheme()}://{dial}:{proc.info['port']}")

    def stop(self, proc: ManagedProcess, grace_s: float | None = None) -> int | None:
        """SIGTERM to the child's process group, SIGKILL after the grace period; returns its exit code."""
        grace = self.stop_grace_s if grace_s is None else grace_s
        if proc.alive():
            _signal_group(proc.popen, signal.SIGTERM)
        _reap(proc, time.monotonic() + grace, grace)
        return proc.popen.returncode

    def stop_together(
        self,
        procs: Sequence[ManagedProcess],
        grace_s: float | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Stops ``procs`` side by side: SIGTERM to each at once, then one grace period for all of
        them (SIGKILL for any still running at its end), so the stop takes as long as the slowest
        one, not the sum, and no longer than it takes. ``meanwhile()`` runs while they stop (it
        raising still stops them). They are this launcher's no more."""
        grace = self.stop_grace_s if grace_s is None else grace_s
        for proc in procs:
            if proc.alive():
                _signal_group(proc.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            for proc in procs:
                _reap(proc, deadline, grace)
                log.info("stopped %s (pid %d), exit code %s", proc.name, proc.pid, proc.popen.returncode)
                with contextlib.suppress(ValueError):  # stop_all must not signal a reused pid later
                    self.processes.remove(proc)

    def stop_all(self) -> None:
        self._log_watch_stop.set()
        # A copy: a supervisor thread may still be starting a process as the job ends.
        for proc in reversed(list(self.processes)):
            try:
                code = self.stop(proc)
                log.info("stopped %s (pid %d), exit code %s", proc.name, proc.pid, code)
            except Exception:
                log.exception("could not stop %s (pid %d)", proc.name, proc.pid)
        self.processes.clear()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _reap(proc: ManagedProcess, deadline: float, grace_s: float) -> None:
    """Waits for a signalled child until ``deadline``, then SIGKILLs its process group: the leader
    may be gone while children it spawned are not."""
    try:
        proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) ignored SIGTERM for %.0f s: killing it", proc.name, proc.pid, grace_s)
    _signal_group(proc.popen, signal.SIGKILL)
    proc.popen.wait()


def _signal_group(popen: subprocess.Popen[bytes] | ForkedChild, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)  # start_new_session=True: the group id is the child's pid
