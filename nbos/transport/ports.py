"""Picking TCP ports for processes that are told their address before they bind.

A port found free by binding port 0 comes from the kernel's ephemeral range, the same
range outgoing connections take their local ports from: between our check and the
process's bind, any ``connect()`` on the machine may take it. Ports are therefore
picked below that range, where only listeners live, checked free by a bind, and never
handed out twice by one process. :func:`bind_port` binds a ZeroMQ socket so, trying
another such port where one was taken meanwhile.
"""

from __future__ import annotations

import errno
import random
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import zmq

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


def bind_port(
    bind: Callable[[int], int], ip: str, port: int = 0, *, keep: bool = False, attempts: int = 5
) -> int:
    """Bind a listening ZeroMQ socket on ``ip`` with ``bind`` (which binds it on the port
    it is given, ``0``: one the OS picks, and returns the port bound); the port bound.

    ``keep``: on ``port`` or not at all (its clients know it already: a front or a
    replica taken back after a restart). Otherwise ``port`` (unless ``0``) is tried
    first, then ports from :func:`free_ports` while the one tried was taken since it was
    checked free (``EADDRINUSE``), ``attempts`` in all, and at last one the OS picks.
    Other errors (and a kept port that is taken) raise ``zmq.ZMQError``.
    """
    if keep:
        return bind(port)
    tries = [port] if port else []
    for _ in range(attempts - 1):
        if not tries:
            try:
                tries = free_ports(1, ip)
            except TransportError:  # an address this machine cannot check: the OS picks
                break
        try:
            return bind(tries.pop())
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    return bind(0)


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
