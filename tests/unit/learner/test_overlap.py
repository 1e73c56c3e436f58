"""PhaseRunner: a learner step's independent phases in order, or side by side in threads."""

from __future__ import annotations

import threading

import pytest
import torch

from rlmesh.learner.ppo.overlap import PhaseRunner


def test_overlapped_phases_run_at_once_each_with_its_share_of_threads():
    runner = PhaseRunner(overlap=True)
    both = threading.Barrier(2, timeout=30)  # passes only if the two phases are running together
    seen: dict[str, tuple[int, str]] = {}

    def phase(name: str) -> str:
        both.wait()
        seen[name] = (torch.get_num_threads(), threading.current_thread().name)
        return name.upper()

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        done = runner.run({"critic": lambda: phase("critic"), "actor": lambda: phase("actor")})
        assert torch.get_num_threads() == 2  # the caller's count is back
    finally:
        torch.set_num_threads(before)
        runner.close()
    assert list(done) == ["critic", "actor"]
    assert [p.result for p in done.values()] == ["CRITIC", "ACTOR"]
    assert all(p.seconds >= 0 and p.start > 0 for p in done.values())
    assert seen["critic"][0] == seen["actor"][0] == 1  # 2 threads shared out
    assert seen["critic"][1] != seen["actor"][1]


def test_in_order_phases_run_on_the_calling_thread():
    order: list[str] = []
    runner = PhaseRunner(overlap=False)
    done = runner.run({n: (lambda n=n: order.append(threading.current_thread().name) or n) for n in "abc"})
    assert [p.result for p in done.values()] == ["a", "b", "c"]
    assert order == [threading.current_thread().name] * 3


def test_a_failing_phase_is_raised_after_the_others_ended():
    runner = PhaseRunner(overlap=True)
    ended = threading.Event()
    failed = threading.Event()

    def fails() -> None:
        failed.set()
        raise RuntimeError("actor update failed")

    def slower() -> None:
        failed.wait(30)  # still running when the other has raised
        ended.set()

    try:
        with pytest.raises(RuntimeError, match="actor update failed"):
            runner.run({"update_actor": fails, "update_critic": slower})
        assert ended.is_set()
        with pytest.raises(ValueError, match="at most 3 phases"):
            runner.run({str(i): (lambda: None) for i in range(4)})
    finally:
        runner.close()
