"""The gloo interface a weight group is made on: pinned only while groups are made, shared by groups
made at once on the same interface, and never over an operator's own GLOO_SOCKET_IFNAME."""

import os
import threading

from rlmesh.weights.group import pinned_gloo_interface

VAR = "GLOO_SOCKET_IFNAME"


def test_the_interface_is_set_while_a_group_is_made_and_cleared_after(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    with pinned_gloo_interface("veth0"):
        assert os.environ[VAR] == "veth0"
        with pinned_gloo_interface("veth0"):  # a second group on the same interface does not wait
            assert os.environ[VAR] == "veth0"
        assert os.environ[VAR] == "veth0"
    assert VAR not in os.environ
    with pinned_gloo_interface(None):
        assert VAR not in os.environ


def test_an_operators_setting_wins(monkeypatch):
    monkeypatch.setenv(VAR, "eth7")
    with pinned_gloo_interface("veth0"):
        assert os.environ[VAR] == "eth7"
    assert os.environ[VAR] == "eth7"


def test_a_group_on_another_interface_waits_for_the_first_to_be_made(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    seen: list[str] = []
    first_done = threading.Event()

    def second() -> None:
        with pinned_gloo_interface("eth1"):
            seen.append(os.environ[VAR])
            seen.append("first done" if first_done.is_set() else "first still pinned")

    with pinned_gloo_interface("veth0"):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(timeout=0.5)  # a bounded look: it must still be waiting
        assert thread.is_alive() and seen == []
        first_done.set()
    thread.join(timeout=30)
    assert seen == ["eth1", "first done"]
    assert VAR not in os.environ
