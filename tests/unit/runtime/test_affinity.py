"""``rlmesh.<service>.cpus``: parsing, errors naming the key, and a real pin of a child process."""

import os
import subprocess
import sys

import pytest

from rlmesh.runtime.affinity import apply_cpu_affinity, parse_cpus


def test_specs_parse_to_core_sets():
    assert parse_cpus("0", "k") == {0}
    assert parse_cpus("1-3", "k") == {1, 2, 3}
    assert parse_cpus("0, 2-3", "k") == {0, 2, 3}


@pytest.mark.parametrize("spec", ["a", "1-", "-1", "3-1", "0;1", ""])
def test_a_malformed_spec_names_the_key(spec):
    with pytest.raises(ValueError, match=r"rlmesh.learner.cpus"):
        parse_cpus(spec, "rlmesh.learner.cpus")


def test_a_core_the_process_may_not_use_is_refused_and_nothing_changes():
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=r"rlmesh.rollout.cpus='4096'.*not available"):
        apply_cpu_affinity("4096", "rlmesh.rollout.cpus")
    assert os.sched_getaffinity(0) == before


def test_an_empty_spec_leaves_the_process_alone():
    assert apply_cpu_affinity("  ", "k") is None


def test_a_child_process_is_pinned_and_what_it_starts_inherits_it():
    core = min(os.sched_getaffinity(0))
    program = (
        "import os, subprocess, sys\n"
        "from rlmesh.runtime.affinity import apply_cpu_affinity\n"
        f"apply_cpu_affinity('{core}', 'k')\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
        " capture_output=True, text=True, check=True)\n"
        "print(sorted(os.sched_getaffinity(0)), child.stdout.strip())\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [f"[{core}]", f"[{core}]"]
