"""A fork server: one process (``rlmesh forkserver``) imports torch, transformers, DeepSpeed and the
services once, and each ``rlmesh.cli`` child a launcher starts is forked from it instead of
importing them again (seconds of CPU each). docs/operations.md#the-fork-server"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger("rlmesh.runtime")

# A launcher's children find the server here, so that their own launchers (a replica starting its
# engine) fork from it too.
SOCKET_ENV = "RLMESH_FORKSERVER"
# Read while the preloaded modules import (or by the interpreter at start): a child whose values
# differ from the server's is started by exec instead, so that it sees them.
IMPORT_TIME_ENV = (
    "OMP_",
    "MKL_",
    "KMP_",
    "DS_",
    "CUDA_",
    "HIP_",
    "TORCH",
    "PYTORCH",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "PYTHON",
    "LD_",
)
READY_TIMEOUT_S = 180.0
_HEADER = struct.Struct("!I")


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def cli_args(argv: Sequence[str]) -> list[str] | None:
    """The ``rlmesh.cli`` arguments of ``argv`` when it is ``<this python> -m rlmesh.cli ...``, else
    None (anything else is exec'd)."""
    if len(argv) >= 3 and argv[0] == sys.executable and list(argv[1:3]) == ["-m", "rlmesh.cli"]:
        return list(argv[3:])
    return None


def _send(conn: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(conn, [payload], list(fds))
    else:
        conn.sendall(payload)


def _recv(conn: socket.socket, *, with_fds: bool = False) -> tuple[dict | None, list[int]]:
    """One message (None at end of stream) and the descriptors that came with it."""
    if with_fds:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
    else:
        data, fds = conn.recv(1 << 16), []
    if not data:
        return None, fds
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        more = conn.recv(1 << 16)
        if not more:
            return None, fds
        data += more
    (size,) = _HEADER.unpack_from(data)
    return json.loads(data[_HEADER.size : _HEADER.size + size]), fds


class ForkedChild:
    """A child forked by the server, with what the launcher uses of ``subprocess.Popen``: ``pid``,
    ``poll``, ``wait``, ``returncode`` and ``send_signal``. Its exit code comes over ``conn``;
    closing ``conn`` (this process dying) makes the server SIGTERM it, as a parent-death signal would."""

    def __init__(self, pid: int, conn: socket.socket, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._conn = conn
        self._lock = threading.Lock()

    def _read(self, timeout: float | None) -> None:
        # Waits outside the lock: a poll from another thread must not wait behind a long wait.
        try:
            ready, _, _ = select.select([self._conn], [], [], timeout)
        except (OSError, ValueError):  # closed by another thread, which read the exit code
            return
        if not ready:
            return
        with self._lock:
            if self.returncode is not None:
                return
            try:
                message, _ = _recv(self._conn)
            except OSError:
                message = None
            # No message: the server is gone (its parent-death signal then stopped this child too).
            self.returncode = int(message["returncode"]) if message is not None else -signal.SIGTERM
            self._conn.close()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client's handle: starts the server (``start``) or reaches one a parent started
    (``inherited``), and forks children from it (``fork``). Any failure makes ``fork`` return None,
    and the launcher starts that child by exec as it would without a server."""

    def __init__(self, socket_path: str, process: subprocess.Popen[bytes] | None = None) -> None:
        self.socket_path = socket_path
        self.process = process
        self.broken: str | None = None

    @classmethod
    def start(cls, env: Mapping[str, str]) -> ForkServer:
        """Starts a server with ``env`` (a launcher's children's environment); it imports while the
        caller goes on. Its log and socket lie in a private directory removed by ``close``."""
        from rlmesh.runtime.launcher import with_parent_death_signal

        where = Path(tempfile.mkdtemp(prefix="rlmesh-fs-"))  # short: a socket path has 108 bytes
        path = where / "socket"
        with open(where / "forkserver.log", "ab") as out:
            process = subprocess.Popen(
                with_parent_death_signal([sys.executable, "-m", "rlmesh.cli", "forkserver", str(path)]),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env),
                start_new_session=True,
            )
        return cls(str(path), process)

    @classmethod
    def inherited(cls) -> ForkServer | None:
        path = os.environ.get(SOCKET_ENV)
        return cls(path) if path else None

    @property
    def log_path(self) -> Path:
        return Path(self.socket_path).with_name("forkserver.log")

    def _connect(self) -> socket.socket | None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.socket_path)
                return conn
            except OSError as e:
                conn.close()
                if self.process is not None and self.process.poll() is not None:
                    self.broken = f"it exited with code {self.process.returncode} ({self._log_tail()})"
                elif self.process is None or time.monotonic() > deadline:
                    self.broken = f"cannot reach it at {self.socket_path}: {e}"
                if self.broken:
                    return None
            time.sleep(0.05)  # it is still importing; it listens once done

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-3:])
        except OSError:
            return "no log"

    def fork(
        self, args: Sequence[str], env: Mapping[str, str], log_fd: int, cwd: str | None = None
    ) -> ForkedChild | None:
        """Forks ``rlmesh.cli <args>`` with ``env``, its output on ``log_fd``; None where the server
        cannot (then exec it)."""
        if self.broken:
            return None
        conn = self._connect()
        if conn is None:
            log.warning("fork server unavailable, starting services by exec: %s", self.broken)
            return None
        request = {"args": list(args), "env": dict(env), "cwd": cwd or os.getcwd()}
        try:
            _send(conn, request, [log_fd])
            reply, _ = _recv(conn)
        except OSError as e:
            reply = {"refused": f"{type(e).__name__}: {e}"}
        if reply is None or "pid" not in reply:
            conn.close()
            why = (reply or {}).get("refused", "it closed the connection")
            log.info("fork server did not fork rlmesh %s (%s): exec instead", " ".join(args[:2]), why)
            return None
        return ForkedChild(int(reply["pid"]), conn, [sys.executable, "-m", "rlmesh.cli", *args])

    def children(self) -> dict[int, int]:
        """Its running children, each with the pid of the process whose launcher asked for it
        (what the process tree shows of exec'd children: a replica's engine is the replica's)."""
        conn = self._connect()
        if conn is None:
            return {}
        with conn:
            _send(conn, {"query": "children"})
            reply, _ = _recv(conn)
        return {int(c): int(p) for c, p in (reply or {}).get("children", {}).items()}

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops a server this handle started (its children are stopped before, by the launcher)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(Path(self.socket_path).parent, ignore_errors=True)


# --- the server's side ------------------------------------------------------------------------


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class _Child(Exception):
    """Raised in a forked child to leave the server's loop with its request."""

    def __init__(self, request: dict, log_fd: int, server_pid: int) -> None:
        super().__init__()
        self.request, self.log_fd, self.server_pid = request, log_fd, server_pid


def serve(socket_path: str, preload: Callable[[], None]) -> list[str]:
    """The server: runs ``preload``, then forks a child for each request until SIGTERM. Returns only
    in a child, set up as exec would have started it, with its ``rlmesh.cli`` arguments."""
    mine = import_time_env(os.environ)  # as started: imports set some (torch's NVML check)
    preload()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # A CUDA context does not survive fork(): the children would fail on their first kernel.
        raise SystemExit("fork server: an import initialised CUDA, not forking")
    try:
        _serve(socket_path, mine)
    except _Child as child:
        return _become(child)
    raise AssertionError("the server's loop returns only in a child")


def _serve(socket_path: str, mine: dict[str, str]) -> None:
    if _threads() != 1:
        # fork() copies only the calling thread: a lock another one held would stay held.
        raise SystemExit(f"fork server: {_threads()} threads after the imports, not forking")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    os.chmod(socket_path, 0o600)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    launchers: dict[int, int] = {}  # pid -> the pid of the process that asked for it
    print(f"fork server ready (pid {os.getpid()}): {socket_path}", flush=True)
    while True:
        open_conns = [c for c in children.values() if c.fileno() != -1]
        readable, _, _ = select.select([listener, wake_r, *open_conns], [], [], 5.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(children, launchers)
        for conn in [c for c in readable if c not in (listener, wake_r)]:
            # A client's end closed (it stopped or died) while its child runs: stop the child,
            # as the parent-death signal of an exec'd child would.
            pid = next((p for p, c in children.items() if c is conn), None)
            with contextlib.suppress(OSError):
                if conn.recv(4096):
                    continue  # nothing is sent after the request: ignored
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGTERM)
                children[pid] = _closed(conn)
        if listener in readable:
            conn, _ = listener.accept()
            try:
                request, fds = _recv(conn, with_fds=True)
            except OSError:
                conn.close()
                continue
            peer_pid, peer_uid, _ = struct.unpack(
                "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            )
            if peer_uid == os.getuid() and request == {"query": "children"}:
                with contextlib.suppress(OSError):
                    _send(conn, {"children": {str(c): p for c, p in launchers.items()}})
                conn.close()
                continue
            refused = "another user" if peer_uid != os.getuid() else _refusal(request, fds, mine)
            if refused:
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    _send(conn, {"refused": refused})
                conn.close()
                continue
            server_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for other in (listener, conn, *open_conns):
                    other.close()
                raise _Child(request, fds[0], server_pid)
            os.close(fds[0])
            children[pid] = conn
            launchers[pid] = peer_pid
            with contextlib.suppress(OSError):
                _send(conn, {"pid": pid})


def _closed(conn: socket.socket) -> socket.socket:
    """A closed stand-in kept for the child until it is reaped (nobody to tell its exit code)."""
    conn.close()
    return conn


def _refusal(request: dict | None, fds: list[int], mine: dict[str, str]) -> str | None:
    if request is None or len(fds) != 1:
        return "a request is a message with one log descriptor"
    differs = sorted(set(import_time_env(request["env"]).items()) ^ set(mine.items()))
    if differs:
        return f"{differs[0][0]} differs from the server's, which imported with its own"
    return None


def _reap(children: dict[int, socket.socket], launchers: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        launchers.pop(pid, None)
        if conn is not None and conn.fileno() != -1:
            with contextlib.suppress(OSError):
                _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            conn.close()


def _become(child: _Child) -> list[str]:
    """In a forked child: what exec would have given ``rlmesh.cli <args>`` (its own session, a
    parent-death signal, its log as output, its environment, directory, title and signal handlers)."""
    import ctypes

    os.setsid()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != child.server_pid:
        os._exit(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(child.log_fd, 1)
    os.dup2(child.log_fd, 2)
    os.close(devnull)
    os.close(child.log_fd)
    args = child.request["args"]
    with contextlib.suppress(ImportError):  # ps shows the command exec would have run (before the
        import setproctitle  # environment changes: the title may take the space after argv)

        setproctitle.setproctitle(" ".join([sys.executable, "-m", "rlmesh.cli", *args]))
    os.chdir(child.request["cwd"])
    os.environ.clear()
    os.environ.update(child.request["env"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [sys.argv[0], *args]
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # as a fresh interpreter seeds it (random reseeds itself)
    return list(args)
