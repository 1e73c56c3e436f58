"""Child processes of the tests: their environment, the programs in ``tests/support/programs``,
and whether a pid is still alive."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
