"""Which dead services ``rlmesh train``'s supervisor restarts, on real processes that exited: the
learner only when it died (a signal, or a rank lost) and its run is not over."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlmesh.job.stack import STANDBY
from rlmesh.job.train import RestartBudget, Supervisor
from rlmesh.runtime.launcher import EXIT_RESTART, ManagedProcess, restartable


def exited(tmp_path: Path, name: str, code: int) -> ManagedProcess:
    """A process of ``name`` that ended with ``code`` (negative: killed by that signal)."""
    if code < 0:
        popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        popen.send_signal(-code)
    else:
        popen = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    popen.wait()
    return ManagedProcess(name=name, argv=[], popen=popen, log_path=tmp_path / f"{name}.log")


class Stack:
    """What the supervisor reads of a stack: its processes, its standby, and what starts them,
    which records the name and hands back a live process."""

    def __init__(self, processes: list[ManagedProcess]) -> None:
        self.named = [(p.name, p) for p in processes]
        self.restarted: list[str] = []
        self.done = threading.Event()
        self.live: list[subprocess.Popen[bytes]] = []

    def processes(self) -> list[tuple[str, ManagedProcess]]:
        return self.named

    @property
    def standby(self) -> SimpleNamespace | None:
        process = dict(self.named).get(STANDBY)
        return SimpleNamespace(process=process) if process is not None else None

    def restart(self, name: str) -> ManagedProcess:
        popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.live.append(popen)
        self.named = [(n, p) for n, p in self.named if n != name] + [
            (name, ManagedProcess(name=name, argv=[], popen=popen, log_path=Path(f"{name}.log")))
        ]
        self.restarted.append(name)
        self.done.set()
        return self.named[-1][1]

    def promote_standby(self) -> SimpleNamespace:
        standby = dict(self.named)[STANDBY]
        self.named = [(n, p) for n, p in self.named if n not in ("learner", STANDBY)] + [("learner", standby)]
        self.restarted.append("promoted")
        return SimpleNamespace(process=standby)

    def start_standby(self) -> SimpleNamespace:
        self.restart(STANDBY)
        return SimpleNamespace(process=dict(self.named)[STANDBY])

    def close(self) -> None:
        for popen in self.live:
            popen.kill()
            popen.wait()


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (-signal.SIGKILL, True),
        (-signal.SIGSEGV, True),
        (EXIT_RESTART, True),
        (137, True),
        (1, False),
        (2, False),
        (0, False),
    ],
)
def test_a_death_is_restartable_a_reported_failure_is_not(code, expected):
    assert restartable(code) is expected


@pytest.mark.parametrize("code", [-signal.SIGKILL, EXIT_RESTART])
def test_a_learner_that_died_is_restarted_and_said_so(tmp_path, code):
    said: list[str] = []
    stack = Stack([exited(tmp_path, "learner", code)])
    try:
        supervisor = Supervisor(stack, RestartBudget(2), said.append)
        assert supervisor.check() == ""
        assert stack.done.wait(30)
        assert stack.restarted == ["learner"]
        assert said[0].startswith(f"learner exited with code {code}: restarting it (1 of 2 this hour)")
        assert "the replicas go on" in said[0]
    finally:
        stack.close()


@pytest.mark.parametrize("run_over", [False, True])
def test_a_learner_that_failed_or_finished_is_left_to_end_the_job(tmp_path, run_over):
    said: list[str] = []
    stack = Stack([exited(tmp_path, "learner", -signal.SIGKILL if run_over else 1)])
    supervisor = Supervisor(stack, RestartBudget(2), said.append)
    supervisor.run_over = run_over
    assert supervisor.check() == ""
    assert (stack.restarted, said, supervisor.restarting) == ([], [], set())


def test_a_learner_over_its_budget_fails_the_job_naming_its_log(tmp_path):
    stack = Stack([exited(tmp_path, "learner", -signal.SIGKILL)])
    supervisor = Supervisor(stack, RestartBudget(0), lambda line: None)
    failure = supervisor.check()
    assert failure.startswith("the learner died (exit code -9); its log: ")
    assert str(tmp_path / "learner.log") in failure and "restarted 0 times within the hour" in failure
    assert stack.restarted == []


def running(name: str) -> ManagedProcess:
    popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return ManagedProcess(name=name, argv=[], popen=popen, log_path=Path(f"{name}.log"))


def test_a_dead_learner_with_a_live_standby_is_replaced_by_it_and_a_new_standby_starts(tmp_path):
    said: list[str] = []
    standby = running(STANDBY)
    stack = Stack([exited(tmp_path, "learner", -signal.SIGKILL), standby])
    stack.live.append(standby.popen)
    try:
        supervisor = Supervisor(stack, RestartBudget(2), said.append)
        assert supervisor.check() == ""
        assert stack.done.wait(30)
        assert stack.restarted == ["promoted", STANDBY]
        assert dict(stack.processes())["learner"] is standby
        assert supervisor.check() == "" and stack.restarted == ["promoted", STANDBY]  # both alive
        assert "its warm standby takes over, a new standby starts" in said[0]
    finally:
        stack.close()


@pytest.mark.parametrize(("code", "restarted"), [(-signal.SIGKILL, [STANDBY]), (0, []), (1, [])])
def test_a_standby_that_died_is_restarted_one_that_ended_is_not(tmp_path, code, restarted):
    said: list[str] = []
    learner = running("learner")
    stack = Stack([learner, exited(tmp_path, STANDBY, code)])
    stack.live.append(learner.popen)
    try:
        supervisor = Supervisor(stack, RestartBudget(2), said.append)
        assert supervisor.check() == "" and supervisor.check() == ""
        if restarted:
            assert stack.done.wait(30)
        assert stack.restarted == restarted
        if code == 1:  # failed by itself: said once, however often it is checked
            assert len(said) == 1 and "the job goes on without one" in said[0], said
        if code == 0:  # it found the run ended by its learner: nothing to say
            assert said == []
    finally:
        stack.close()


def test_a_standby_over_its_budget_leaves_the_job_running_without_one(tmp_path):
    said: list[str] = []
    learner = running("learner")
    stack = Stack([learner, exited(tmp_path, STANDBY, -signal.SIGKILL)])
    stack.live.append(learner.popen)
    try:
        supervisor = Supervisor(stack, RestartBudget(0), said.append)
        assert supervisor.check() == "" and supervisor.check() == ""
        assert stack.restarted == [] and supervisor.failure == ""
        assert len(said) == 1 and said[0].endswith("the job goes on without a standby"), said
    finally:
        stack.close()
