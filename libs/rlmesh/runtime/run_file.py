"""The run file: where a running job's control plane serves, written by ``rlmesh train`` into its
checkpoint directory and the user's runs directory, read by ``rlmesh ctl``; no secret in it.
docs/control.md#rlmesh-ctl"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from rlmesh.runtime.tls import TlsFiles

RUN_FILE = "rlmesh-run.json"
ENV_RUNS_DIR = "RLMESH_RUNS_DIR"


@dataclass(frozen=True)
class RunInfo:
    """A job as ``rlmesh ctl`` needs to know it. ``config``: the file it was started with, whose
    ``rlmesh.auth_token`` a bare ``rlmesh ctl`` uses; ``tls``: the certificate, key and CA files
    of an HTTPS plane (paths only); ``started``: the process's start time, so a reused pid is not
    taken for the job."""

    run_id: str
    url: str
    pid: int
    host: str
    started: str
    checkpoint_dir: str
    config: str | None = None
    auth: bool = False
    tls: dict[str, str] | None = None
    path: Path | None = field(default=None, compare=False)  # where it was read from


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), None when there is none or it is a
    zombie; "" where there is no /proc to tell (then it only exists)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # someone else's: it exists
            pass
        return ""
    fields = stat.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]


def this_process(
    run_id: str,
    url: str,
    checkpoint_dir: Path,
    *,
    config: str | None = None,
    auth: bool = False,
    tls: TlsFiles | None = None,
) -> RunInfo:
    """The ``RunInfo`` of the job this process runs (paths made absolute: ``rlmesh ctl`` may run
    elsewhere)."""
    pid = os.getpid()
    return RunInfo(
        run_id=run_id,
        url=url,
        pid=pid,
        host=socket.gethostname(),
        started=process_start(pid) or "",
        checkpoint_dir=str(checkpoint_dir.resolve()),
        config=_absolute(config) if config else None,
        auth=auth,
        tls=None
        if tls is None
        else {k: _absolute(getattr(tls, k)) for k in ("cert_file", "key_file", "ca_file")},
    )


def _absolute(path: str) -> str:
    return str(Path(path).resolve())


def tls_files(info: RunInfo) -> TlsFiles | None:
    """The TLS files a client of the run's HTTPS control plane uses (None: plain HTTP)."""
    return TlsFiles(**info.tls) if info.tls else None


def is_live(info: RunInfo) -> bool:
    """Whether the job is still running; one on another host is taken to be (it cannot be told)."""
    if info.host != socket.gethostname():
        return True
    started = process_start(info.pid)
    return started is not None and (not info.started or not started or started == info.started)


def user_runs_dir() -> Path:
    """Where every job of this user is listed, whatever its directory: a bare ``rlmesh ctl`` finds
    the only one running there. Env ``RLMESH_RUNS_DIR``, else ``$XDG_CACHE_HOME/rlmesh/runs``."""
    if os.environ.get(ENV_RUNS_DIR):
        return Path(os.environ[ENV_RUNS_DIR]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "rlmesh" / "runs"


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, 0600, replaced at once (a reader sees the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file of that name keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _listing_name(run_id: str) -> str:
    return re.sub(r"[^\w.-]", "_", run_id) + ".json"


def read_run_file(path: Path) -> RunInfo | None:
    """The run file at ``path``; None when there is none, or it is not one (a half-written or
    foreign file is no run). One another user owns or may write is none either: ctl would send the
    token to the URL it names."""
    try:
        st = path.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None
        data: Any = json.loads(path.read_text())
        data.pop("path", None)
        return RunInfo(**data, path=path)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed since it was listed: read_run_file skips it
        return 0.0


def running_jobs() -> list[RunInfo]:
    """The user's jobs running on this host, listed in ``user_runs_dir()``, oldest first. The
    entry of a job that ended without removing it (killed) is removed here."""
    folder = user_runs_dir()
    jobs = []
    for path in sorted(folder.glob("*.json"), key=_mtime) if folder.is_dir() else []:
        info = read_run_file(path)
        if info is None or info.host != socket.gethostname():
            continue
        if is_live(info):
            jobs.append(info)
        else:
            path.unlink(missing_ok=True)
    return jobs


class RunFiles:
    """The files a job publishes itself in, removed when it ends (``with RunFiles() as files``)."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def write(self, info: RunInfo) -> list[Path]:
        """Writes ``info`` into ``<checkpoint dir>/rlmesh-run.json`` and the user's runs directory
        (0700: another user may not even list the runs); returns the files written. One that
        cannot be written (a read-only home) is left out: the job goes on without it."""
        text = json.dumps({k: v for k, v in asdict(info).items() if k != "path"}, indent=2) + "\n"
        listed = user_runs_dir() / _listing_name(info.run_id)
        for path, private_dir in ((Path(info.checkpoint_dir) / RUN_FILE, False), (listed, True)):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                if private_dir:
                    path.parent.chmod(0o700)
                _write_private(path, text)
            except OSError:
                continue
            self.paths.append(path)
        return list(self.paths)

    def remove(self) -> None:
        """Removes the files this process wrote (not one a newer job wrote over them)."""
        for path in self.paths:
            info = read_run_file(path)
            if info is not None and info.pid == os.getpid():
                path.unlink(missing_ok=True)
        self.paths.clear()

    def __enter__(self) -> RunFiles:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()
