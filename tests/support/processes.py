"""Child processes of the tests: their environment, the programs in ``tests/support/programs``,
whether a pid is still alive, and a parent killed with its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.polling import wait_until

PROGRAMS = "tests.support.programs"


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def program(name: str, *args: object) -> list[str]:
    """The command that runs ``tests/support/programs/<name>.py`` with ``args``; start it with the
    repository root (``tests.support.repo.REPO``) as its working directory."""
    return [sys.executable, "-m", f"{PROGRAMS}.{name}", *map(str, args)]


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a reaped-later corpse counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def kill_and_wait_for_children(parent: subprocess.Popen[str], children: dict[str, int], why: str) -> None:
    """``kill -9`` of ``parent`` (no cleanup code of its runs), then waits until each of
    ``children`` (name -> pid) has exited too; ``why``: what takes them down, for the failure."""
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        for name, pid in children.items():
            wait_until(lambda pid=pid: not pid_alive(pid), 60, f"{name} (pid {pid}) to exit {why}")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
