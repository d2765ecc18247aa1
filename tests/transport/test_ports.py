"""Ports handed to processes before they bind: free, distinct, outside the ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

from nbos.transport.ports import free_loopback_address, free_loopback_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [*free_loopback_ports(50), int(free_loopback_address().rsplit(":", 1)[1])]
    assert len(set(ports)) == len(ports)
    assert all(1024 < p < start for p in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out() -> None:
    held = []
    try:
        for port in free_loopback_ports(20):
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            sock.listen()
            held.append(sock)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & set(free_loopback_ports(200))
    finally:
        for sock in held:
            sock.close()
