"""benchmarks/bench_push_groups.py: engines on hosts of their own (network namespaces on a
bridge, shaped links) take every push, and the bytes that leave the learner are one copy per
engine with a group each and ⌈log2(engines + 1)⌉ copies with one shared group (gloo's tree).
Needs root and iproute2, as test_addresses_netns does."""

import json
import math
import subprocess
import sys

from tests.support.repo import REPO

sys.path.insert(0, str(REPO))
from benchmarks.bench_push_groups import main


def test_one_shared_group_sends_log2_copies_out_of_the_learner_and_a_group_each_one_per_engine(tmp_path):
    engines = 3
    before = _bench_links()
    argv = ["--engines", str(engines), "--mb", "2", "--pushes", "2", "--rate-mbit", "2000"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    apart, shared = json.loads((tmp_path / "results.json").read_text())
    assert (apart["group_size"], shared["group_size"]) == (1, engines)
    assert apart["weight_bytes"] == shared["weight_bytes"] == 2 << 20
    # The bridge also carried the HTTP calls around each push: well under a copy.
    assert round(apart["copies_out"]) == engines and apart["copies_out"] < engines + 0.5
    assert round(shared["copies_out"]) == math.ceil(math.log2(engines + 1))
    assert _bench_links() == before  # the hosts it made are gone


def _bench_links() -> list[str]:
    """The bench's bridges and veths (names rpb..., rph...) and namespaces (rpg...) on this machine."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout.split(
        "\n"
    )
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split(
        "\n"
    )
    names = [line.split(":")[1].strip().split("@")[0] for line in links if line.count(":") >= 2]
    return sorted(
        n for n in names + [s.split()[0] for s in spaces if s] if n.startswith(("rpb", "rph", "rpg"))
    )
