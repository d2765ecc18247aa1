"""Ports handed to processes before they bind: free, distinct, outside the ephemeral range."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from nbos.transport.ports import bind_port, free_loopback_address, free_loopback_ports
from tests.agent._daemons import ROOT

EPHEMERAL_START = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


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


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _binder(sock: zmq.Socket[bytes]) -> Callable[[int], int]:
    def bind(port: int) -> int:
        sock.bind(f"tcp://127.0.0.1:{port}")
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        return int(endpoint.rsplit(b":", 1)[1])

    return bind


def test_a_port_taken_meanwhile_gives_way_to_a_fresh_one_below_the_ephemeral_range(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    squatter = ctx.socket(zmq.ROUTER)
    [taken] = free_loopback_ports(1)
    squatter.bind(f"tcp://127.0.0.1:{taken}")
    sock = ctx.socket(zmq.ROUTER)
    port = bind_port(_binder(sock), "127.0.0.1", taken)
    assert port != taken and 1024 < port < EPHEMERAL_START
    # No port given: a fresh one, not one from the ephemeral range.
    assert bind_port(_binder(ctx.socket(zmq.ROUTER)), "127.0.0.1") < EPHEMERAL_START


def test_a_kept_port_that_is_taken_raises(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    squatter = ctx.socket(zmq.ROUTER)
    [taken] = free_loopback_ports(1)
    squatter.bind(f"tcp://127.0.0.1:{taken}")
    with pytest.raises(zmq.ZMQError) as failed:
        bind_port(_binder(ctx.socket(zmq.ROUTER)), "127.0.0.1", taken, keep=True)
    assert failed.value.errno == errno.EADDRINUSE


def test_two_processes_picking_at_once_never_pick_the_same_port() -> None:
    """Agents of one machine pick ports for replicas that bind them seconds later: each pick
    is claimed machine-wide, so no two processes are handed one port (each picks 600 here,
    enough for dozens of shared ones without the claims)."""
    script = (
        "import json, sys; from nbos.transport.ports import free_ports; "
        "sys.stdin.readline(); print(json.dumps(free_ports(600)))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for _ in range(2)
    ]
    for p in procs:  # both started (imports done or not): let them pick at once
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.flush()
    picked = [set(json.loads(p.communicate(timeout=120)[0])) for p in procs]
    assert all(len(ports) == 600 for ports in picked)
    assert picked[0].isdisjoint(picked[1]), sorted(picked[0] & picked[1])
