"""Picking TCP ports for processes that are told their address before they bind.

A port found free by binding port 0 comes from the kernel's ephemeral range, the same
range outgoing connections take their local ports from: between our check and the
process's bind, any ``connect()`` on the machine may take it. Ports are therefore
picked below that range, where only listeners live, checked free by a bind, and never
handed out twice on one machine within :data:`CLAIM_S`: each pick is claimed by a file
created exclusively in a directory every process of this user shares (the agents of a
machine pick Raft and Jupyter ports for replicas that bind them seconds later; two picking
the same one cost a replica its start). :func:`bind_port` binds a ZeroMQ socket so,
trying another such port where one was taken meanwhile.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from nbos.core.errors import TransportError

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOOPBACK = "127.0.0.1"
_LOWEST = 10_000
#: How long a port picked by one process is not picked by another (seconds): far longer
#: than a replica takes to bind the ports it was told.
CLAIM_S = 300.0
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
        if port not in _issued and _bindable(ip, port) and _claim(port):
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


def _claim(port: int) -> bool:
    """Claim ``port`` for this process machine-wide; ``False`` if another process holds a
    claim younger than :data:`CLAIM_S`. A directory that cannot be written claims nothing
    and refuses nothing (the bind check alone then guards the pick)."""
    claims = Path(tempfile.gettempdir()) / f"nbos-ports-{os.getuid()}"
    path = claims / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            try:
                if time.time() - path.stat().st_mtime < CLAIM_S:
                    return False
                path.unlink()  # a stale claim: taken again below
            except FileNotFoundError:
                pass
        except FileNotFoundError:
            try:
                claims.mkdir(mode=0o700, exist_ok=True)
            except OSError:
                return True
        except OSError:
            return True
        else:
            return True
    return False
