"""rotate_log: copy and truncate past the size limit, older copies shifted and the oldest dropped,
every file 0600; a writer with an O_APPEND descriptor goes on at the new end."""

import os
import stat

from rlmesh.runtime.launcher import open_private_log, rotate_log


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_a_log_under_the_limit_or_absent_is_left_alone(tmp_path):
    log = tmp_path / "x.log"
    assert not rotate_log(log, max_bytes=10)
    log.write_text("short")
    assert not rotate_log(log, max_bytes=10)
    assert log.read_text() == "short" and not (tmp_path / "x.log.1").exists()


def test_copies_shift_up_and_the_oldest_is_dropped(tmp_path):
    log = tmp_path / "x.log"
    for text in ("first " * 5, "second " * 5, "third " * 5):
        log.write_text(text)
        assert rotate_log(log, max_bytes=10, backups=2)
        assert log.read_text() == ""
    assert (tmp_path / "x.log.1").read_text() == "third " * 5
    assert (tmp_path / "x.log.2").read_text() == "second " * 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.log", "x.log.1", "x.log.2"]
    assert mode(tmp_path / "x.log.1") == 0o600


def test_without_backups_the_log_is_only_truncated(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("y" * 100)
    assert rotate_log(log, max_bytes=10, backups=0)
    assert log.read_text() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["x.log"]


def test_a_writer_keeps_its_descriptor_and_writes_at_the_new_end(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("")
    log.chmod(0o644)  # made before: narrowed when opened for a child
    fd = open_private_log(log)
    try:
        assert mode(log) == 0o600
        os.write(fd, b"a" * 50)
        assert rotate_log(log, max_bytes=10)
        os.write(fd, b"b" * 5)
    finally:
        os.close(fd)
    assert log.read_bytes() == b"b" * 5  # no hole of NULs where the old content was
    assert (tmp_path / "x.log.1").read_bytes() == b"a" * 50
