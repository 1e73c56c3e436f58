"""The launcher's per-child logs: only their owner can read them, and they rotate past a size limit,
also while the child writes to them and when a child of the same name starts again."""

import os
import stat
import sys

from rlmesh.runtime.launcher import ProcessLauncher

# Writes a line of a's past the limit, waits until the test opens the FIFO (so the a's are in the
# log by then) and writes to it, then writes b's.
WRITER = """
import sys
sys.stdout.write("a" * 3000 + "\\n"); sys.stdout.flush()
with open(sys.argv[1]) as fifo:
    fifo.read()
sys.stdout.write("b" * 10 + "\\n"); sys.stdout.flush()
"""


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_a_running_childs_log_is_private_and_rotates_under_it(tmp_path):
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    with ProcessLauncher(tmp_path / "work", log_max_bytes=1000, log_backups=2) as launcher:
        proc = launcher.spawn("writer", [sys.executable, "-c", WRITER, str(fifo)])
        assert mode(proc.log_path) == 0o600 and mode(proc.log_path.parent) == 0o700
        with open(fifo, "w") as go:  # opens once the child has written its a's
            launcher.rotate_logs()  # the launcher's own thread may have done it first: the same
            go.write("go")
        assert proc.popen.wait(timeout=60) == 0
        rotated = proc.log_path.with_name("writer.log.1")
        assert rotated.read_text() == "a" * 3000 + "\n" and mode(rotated) == 0o600
        assert proc.log_path.read_text() == "b" * 10 + "\n"
        assert proc.log_tail(2).splitlines() == ["a" * 3000, "b" * 10]  # reaches into the copy


def test_a_child_started_again_under_its_name_rotates_the_old_log(tmp_path):
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    old = work / "logs" / "again.log"
    old.write_text("x" * 2000)
    old.chmod(0o644)
    with ProcessLauncher(work, log_max_bytes=1000) as launcher:
        proc = launcher.spawn("again", [sys.executable, "-c", "print('second life')"])
        assert proc.popen.wait(timeout=60) == 0
        assert (work / "logs" / "again.log.1").read_text() == "x" * 2000
        assert old.read_text() == "second life\n" and mode(old) == 0o600
