"""The namespace harness itself: hosts reach each other by address, partitions cut, heal mends."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests._servers.netns import Netns, netns_or_skip

# Connects to argv[1]:argv[2] and prints what the server says; exits 1 if it cannot.
_CLIENT = (
    "import socket, sys\n"
    "try:\n"
    "    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)\n"
    "    print(s.recv(16).decode())\n"
    "except OSError as exc:\n"
    "    print(exc); sys.exit(1)\n"
)
_SERVER = (
    "import socket\n"
    "s = socket.create_server((__import__('sys').argv[1], 7000))\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(b'hello'); c.close()\n"
)


@pytest.fixture
def net() -> Iterator[Netns]:
    yield from netns_or_skip(["a", "b"])


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def _connect(net: Netns, host: str, to: str) -> subprocess.CompletedProcess[str]:
    return _run(net.argv(host, [sys.executable, "-c", _CLIENT, net.address(to), "7000"]))


def test_hosts_talk_by_address_until_partitioned_and_again_when_healed(net: Netns) -> None:
    server = net.popen(
        "a", [sys.executable, "-c", _SERVER, net.address("a")], stdout=subprocess.PIPE
    )
    assert server.stdout is not None and server.stdout.readline() == b"ready\n"
    assert net.address("a") != net.address("b")
    assert _connect(net, "b", "a").stdout.strip() == "hello"
    net.partition("a")
    assert _connect(net, "b", "a").returncode == 1
    # Loopback inside a cut-off host still works.
    assert _connect(net, "a", "a").stdout.strip() == "hello"
    net.heal("a")
    assert _connect(net, "b", "a").stdout.strip() == "hello"


def test_stop_removes_exactly_its_namespaces(net: Netns) -> None:
    made = list(net.made)
    assert len(made) == 3  # the hub and two hosts
    net.stop()
    listed = _run(["ip", "netns", "list"]).stdout
    assert not any(name in listed for name in made)
