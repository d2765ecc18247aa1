"""Picking TCP ports for processes that are told their address before they bind.

A port found free by binding port 0 comes from the kernel's ephemeral range, the same
range outgoing connections take their local ports from: between our check and the
process's bind, any ``connect()`` on the machine may take it. Ports are therefore
picked below that range, where only listeners live, checked free by a bind, and never
handed out twice by one process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

from nbos.core.errors import TransportError

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOOPBACK = "127.0.0.1"
_LOWEST = 10_000
_issued: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()


def free_ports(count: int, ip: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports on ``ip`` (an address of this machine), free now and
    outside the ephemeral range; never one this process handed out before."""
    with _lock:
        return [_pick(ip) for _ in range(count)]


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 (:func:`free_ports`)."""
    return free_ports(count)


def free_loopback_address() -> str:
    """A ``tcp://127.0.0.1:PORT`` address from :func:`free_loopback_ports`."""
    return f"tcp://{LOOPBACK}:{free_loopback_ports(1)[0]}"


def _pick(ip: str) -> int:
    highest = _ephemeral_start() - 1
    for _ in range(1000):
        port = _rng.randint(_LOWEST, highest)
        if port not in _issued and _bindable(ip, port):
            _issued.add(port)
            return port
    raise TransportError(f"no free port found on {ip} in {_LOWEST}-{highest}")


def _ephemeral_start() -> int:
    try:
        start = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32_768  # Linux's default
    return max(start, _LOWEST + 1000)


def _bindable(ip: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True
