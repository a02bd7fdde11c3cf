"""sim.localapi.free_port: a port for a server started later, picked where no outgoing connection
can take it meanwhile (a real-node test's agent once failed to bind its health port: an
outgoing connection had taken the port bind(0) had picked, inside the kernel's ephemeral
range)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dra_driver.sim.localapi import free_port, server


def ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_the_port_is_below_the_ephemeral_range_and_free() -> None:
    low = ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), sorted(ports)
    assert len(ports) > 1  # not one fixed port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))  # free: a server can bind it


def test_a_port_another_listener_holds_is_not_handed_out() -> None:
    low = ephemeral_low()
    held = []
    try:
        for port in range(max(1024, low - 12000), low, 97):  # a spread of the ports it picks
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & {free_port() for _ in range(200)}
    finally:
        for s in held:
            s.close()


def test_an_ephemeral_range_from_1024_leaves_the_choice_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # nothing lies below such a range: the kernel's port, not an error from an empty range
    monkeypatch.setattr(server, "_ephemeral_low", lambda: 1024)
    port = free_port()
    assert port >= 1024
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
