"""One intra-op thread per test process, and how `make test` hands tests to its pytest-xdist
workers (--dist loadgroup): a module's tests to one worker, tests/e2e's whole jobs in two lanes."""

import os

import pytest
from xdist.scheduler import LoadScopeScheduling

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

E2E = "tests/e2e/"
# A whole job keeps both cores of a small machine busy: two at a time is what it takes, and more
# made jobs miss their deadlines (a reward call retried, a prompt scored twice). So the whole jobs
# run one after another in two lanes, each a pytest-xdist worker, balanced by `make test-e2e`'s
# durations; these modules (about 10 minutes of whole jobs) are the second lane, the rest the first.
SECOND_LANE = {
    "test_train.py",
    "test_demo.py",
    "test_estimators.py",
    "test_control.py",
    "test_monitoring.py",
    "test_ctl.py",
}


def worker_group(nodeid: str) -> str:
    """The tests one worker runs one after another: a module's tests share its module-scoped
    fixtures (a Redis, a stack of services), which a second worker would start again."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(E2E) and "/" not in module.removeprefix(E2E):
        return "whole-jobs-2" if module.removeprefix(E2E) in SECOND_LANE else "whole-jobs-1"
    return module


class WorkerGroups(LoadScopeScheduling):
    """xdist's own loadgroup reads ``xdist_group`` marks through a node id that pytest 9 no longer
    lets it change; this groups by ``worker_group`` instead."""

    def _split_scope(self, nodeid: str) -> str:
        return worker_group(nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> WorkerGroups | None:
    return WorkerGroups(config, log) if config.getvalue("dist") == "loadgroup" else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The lanes are handed out first (with --no-loadscope-reorder), the short tests last.
    items.sort(key=lambda item: worker_group(item.nodeid).startswith("whole-jobs-"), reverse=True)
