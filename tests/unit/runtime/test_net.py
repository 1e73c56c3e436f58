"""free_port: the OS's pick, or the lowest free port of a range (rlmesh.weight_sync.master_port)."""

from __future__ import annotations

import socket

from rlmesh.runtime.net import LOOPBACK, free_port


def test_first_gives_the_lowest_free_port_from_it_up():
    with socket.socket() as held:
        held.bind((LOOPBACK, 0))
        taken = held.getsockname()[1]
        # The held port is skipped; the answer is above it and bindable.
        port = free_port(LOOPBACK, first=taken)
        assert port > taken
        with socket.socket() as s:
            s.bind((LOOPBACK, port))


def test_without_first_any_free_port():
    port = free_port(LOOPBACK)
    with socket.socket() as s:
        s.bind((LOOPBACK, port))
