"""The learner's side of a weight group listens on the address engines are told to dial, never on
every interface (torch's own store would), and only falls back to that where the address is not
one of this machine's."""

import logging
import subprocess
import sys
import threading

import psutil
import torch
import torch.distributed as dist

from rlmesh.learner.weight_sync.links import store_socket
from rlmesh.weights.group import destroy_process_group, init_custom_process_group, listen_socket
from tests.support.processes import child_env
from tests.support.repo import REPO

WILDCARDS = {"0.0.0.0", "::"}

# Rank 1 of the group, as an engine joins it: receives a broadcast and prints it.
ENGINE = """
import sys, torch, torch.distributed as dist
from rlmesh.weights.group import init_custom_process_group
pg = init_custom_process_group("gloo", sys.argv[1], 2, 1, "bind-test", 60.0)
t = torch.zeros(3)
dist.broadcast(t, src=0, group=pg)
print(t.tolist(), flush=True)
"""


def listening() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"
    }


def test_the_group_store_listens_on_the_master_address_alone():
    before = listening()
    sock = listen_socket("127.0.0.1")
    port = sock.getsockname()[1]
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, f"tcp://127.0.0.1:{port}"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    made: dict[str, dist.ProcessGroup] = {}
    host = threading.Thread(
        target=lambda: made.update(
            pg=init_custom_process_group(
                "gloo", f"tcp://127.0.0.1:{port}", 2, 0, "bind-test", 60.0, listen=sock
            )
        )
    )
    host.start()
    host.join(timeout=90)
    try:
        assert "pg" in made, "the engine never joined"
        new = listening() - before
        assert ("127.0.0.1", port) in new
        assert not [a for a in new if a[0] in WILDCARDS], new
        dist.broadcast(torch.tensor([1.0, 2.0, 3.0]), src=0, group=made["pg"])
        out, _ = engine.communicate(timeout=60)
        assert out.strip() == "[1.0, 2.0, 3.0]"
    finally:
        if engine.poll() is None:
            engine.kill()
        if "pg" in made:
            destroy_process_group(made["pg"])


def test_a_range_gives_the_lowest_free_port_from_its_start():
    taken = listen_socket("127.0.0.1")
    try:
        first = taken.getsockname()[1]
        with listen_socket("127.0.0.1", first) as sock:
            assert sock.getsockname()[0] == "127.0.0.1" and sock.getsockname()[1] > first
    finally:
        taken.close()


def test_an_address_of_this_machine_is_bound_alone(caplog):
    with store_socket("127.0.0.1") as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
    with store_socket("localhost") as sock:
        assert sock.getsockname()[0] in {"127.0.0.1", "::1"}
    assert "every interface" not in caplog.text


def test_an_address_behind_nat_falls_back_to_every_interface_with_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="rlmesh.weights")
    with store_socket("192.0.2.7") as sock:  # TEST-NET-1: never an address of this machine
        assert sock.getsockname()[0] == "0.0.0.0"
    assert "192.0.2.7" in caplog.text and "every interface" in caplog.text
