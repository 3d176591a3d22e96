"""The launcher's rendezvous port: drawn below the kernel's ephemeral range, and free."""

from __future__ import annotations

import socket

import pytest

from visionloop.train import launch


def test_rank_zeros_port_is_free_and_outside_the_ephemeral_range() -> None:
    low, high = launch.RENDEZVOUS_PORTS
    ports = [launch.free_port() for _ in range(20)]
    assert all(low <= p < high for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[0]))  # still free: nothing held it


def _bound(port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two ports in the range, the first held: the second comes back every time (the chance
    # that 100 draws miss it is 2^-100).
    port = launch.RENDEZVOUS_PORTS[0]
    while (held := _bound(port)) is None or (free := _bound(port + 1)) is None:
        if held is not None:
            held.close()
        port += 2
    free.close()
    try:
        monkeypatch.setattr(launch, "RENDEZVOUS_PORTS", (port, port + 2))
        assert {launch.free_port() for _ in range(10)} == {port + 1}
    finally:
        held.close()
