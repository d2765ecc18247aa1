"""A front's identity (key, session, ports) outlives its sockets."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import zmq

from nbos.core.errors import TransportError
from nbos.kernel.front import KernelFront, ReplicaEndpoint

pytestmark = pytest.mark.anyio

EPHEMERAL_START = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
#: A replica that never answers: the front binds its own ports regardless.
SILENT = {
    "transport": "tcp",
    "ip": "127.0.0.1",
    "shell_port": 1,
    "iopub_port": 2,
    "stdin_port": 3,
    "control_port": 4,
    "hb_port": 5,
    "key": "k",
    "signature_scheme": "hmac-sha256",
}


async def test_identity_and_connection_info_stay_readable_after_the_front_stopped() -> None:
    # The gateway writes its state file while a kernel stops: a closed front must still
    # say which ports it had (it once raised ZMQError "not a socket" there).
    front = KernelFront([ReplicaEndpoint(1, SILENT)], kernel_id="k1")
    before = front.identity
    with anyio.move_on_after(0.2):
        await front.serve()  # waits for the silent replica, then closes its sockets
    after = front.identity
    assert after == before
    assert set(after.ports) == {"shell_port", "iopub_port", "stdin_port", "control_port", "hb_port"}
    # Below the ephemeral range: bound again after a gateway restart, a port in that range
    # may be some connection's source port by then (a kernel was lost so in CI).
    assert all(0 < port < EPHEMERAL_START for port in after.ports.values()), after.ports
    assert front.connection_info["shell_port"] == after.ports["shell_port"]


async def test_a_front_that_cannot_bind_a_port_raises_and_frees_the_ports_it_bound() -> None:
    first = KernelFront([ReplicaEndpoint(1, SILENT)], kernel_id="k1")
    with anyio.move_on_after(0.2):
        await first.serve()
    identity = first.identity
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.ROUTER)
    squatter.bind(f"tcp://127.0.0.1:{identity.ports['hb_port']}")  # the last one bound
    try:
        with pytest.raises(TransportError, match="cannot bind its front") as failed:
            KernelFront([ReplicaEndpoint(1, SILENT)], kernel_id="k1", identity=identity)
    finally:
        squatter.close(0)
        ctx.term()
    # Its other four ports were let go, not left to the garbage collector (``failed``
    # keeps the failed front's frames alive): a front can take them all now.
    again = KernelFront([ReplicaEndpoint(1, SILENT)], kernel_id="k1", identity=identity)
    del failed
    with anyio.move_on_after(0.2):
        await again.serve()
    assert again.identity == identity
