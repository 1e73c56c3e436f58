"""The walkthrough of docs/train.md ("Walkthrough: your own task in an afternoon") as its reader
follows it: every file block saved under the name its first line gives, every command of a bash
block run in order, in an empty directory."""

from __future__ import annotations

import re
import runpy
import shlex
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.repo import REPO

DOC = REPO / "docs" / "train.md"
HEADING = "### Walkthrough: your own task in an afternoon"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
# A file block's first line names the file: "# make_data.py: what it does".
FILE_NAME = re.compile(r"^# ([\w.-]+\.(?:py|yaml)):")


@dataclass(frozen=True)
class Step:
    file: str | None  # the file a block is saved as; None for a command
    text: str  # the file's content, or the command line

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)


def walkthrough_text(doc: Path = DOC) -> str:
    text = doc.read_text()
    start = text.index(HEADING)
    end = text.find("\n### ", start + len(HEADING))
    return text[start : end if end >= 0 else len(text)]


def walkthrough_steps(doc: Path = DOC) -> list[Step]:
    """The files and commands of the walkthrough, in the order the reader meets them."""
    steps = []
    for lang, body in FENCE.findall(walkthrough_text(doc)):
        if lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                if line.strip():
                    steps.append(Step(None, line.strip()))
            continue
        name = FILE_NAME.match(body)
        if name is None:
            raise ValueError(f"a {lang} block of the walkthrough does not start with '# <file name>:'")
        steps.append(Step(name.group(1), body))
    return steps


def rlmesh_in_process(argv: list[str]) -> int:
    """``rlmesh ARGV`` in this process; the signal handlers the command installs are put back."""
    from rlmesh.cli import main

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return main(argv)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def follow(workdir: Path, *, train: Callable[[list[str]], None] | None = None) -> list[Step]:
    """Does what the walkthrough says in ``workdir`` (the current directory must be it): saves the
    files, runs ``python FILE`` and every ``rlmesh`` command in this process, and hands
    ``rlmesh train`` to ``train`` (skipped when None: a whole job is an e2e test's). Returns the
    steps; a command that fails raises."""
    assert Path.cwd() == workdir.resolve()
    steps = walkthrough_steps()
    for step in steps:
        if step.file is not None:
            (workdir / step.file).write_text(step.text)
            continue
        argv = step.argv
        if argv[0] == "python":
            runpy.run_path(argv[1], run_name="__main__")
        elif argv[:2] == ["rlmesh", "train"]:
            if train is not None:
                train(argv[1:])
        elif argv[0] == "rlmesh":
            code = rlmesh_in_process(argv[1:])
            if code != 0:
                raise AssertionError(f"`{step.text}` exited with {code}")
        else:
            raise AssertionError(f"the walkthrough runs {step.text!r}, which this helper cannot")
    return steps
