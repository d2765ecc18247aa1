"""A gateway with keys: each kernel's replicas speak CURVE among themselves and with the
front, with the kernel's own keys.

A peer without the kernel's key pair, probing a replica's Raft port (which also carries
forwarded proposals) or its Jupyter sockets with another pair or with no CURVE at all,
never completes a handshake (the replica logs the refused key), while one holding the
kernel's pair does; the kernel runs cells meanwhile and after a replica's replacement,
which joins over CURVE.
"""

from __future__ import annotations

import stat
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.utils.monitor

from nbos.gateway._state import StateFile
from nbos.gateway.service import GatewayService
from nbos.transport import CurveKeys
from nbos.transport.keys import generate_keys, take_kernel_keys
from nbos.transport.zmq import curve_client
from tests.agent._daemons import DEADLINE
from tests.gateway._service import local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

_OUTCOMES = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


#: A replica's Jupyter sockets that a DEALER may connect to (IOPub is a publisher).
_ROUTERS = ("shell", "stdin", "control", "hb")


def _handshake(address: str, curve: CurveKeys | None, server_key: bytes) -> int:
    """How a DEALER's first handshake with ``address`` ends: a ``zmq.EVENT_HANDSHAKE_*``."""
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        if curve is not None:
            curve_client(dealer, curve, server_key)
        monitor = dealer.get_monitor_socket(_OUTCOMES)
        dealer.connect(address)
        # A refused peer sends, as a member would, in case anything got through.
        dealer.send(b"not a member", zmq.NOBLOCK)
        assert monitor.poll(DEADLINE * 1000), f"no handshake with {address}"
        return int(zmq.utils.monitor.recv_monitor_message(monitor)["event"])
    finally:
        ctx.destroy(linger=0)


def _logged(root: Path, text: str) -> bool:
    """Whether some log file under ``root`` holds ``text``."""
    return any(text in p.read_text(errors="replace") for p in root.rglob("*.log"))


async def test_replicas_admit_only_their_kernels_keys_and_survive_a_replacement(
    tmp_path: Path,
) -> None:
    generate_keys(tmp_path / "keys", ["host-1", "host-2", "host-3"])
    settings = local_settings(tmp_path, keys=str(tmp_path / "keys"))
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        kernel = await service.kernel_manager.start_kernel()
        assert (await kernel.execute("x = 41")).status == "ok"

        state = StateFile(tmp_path / "run" / "gateway" / "state.json")
        assert stat.S_IMODE(state.path.stat().st_mode) == 0o600
        [record] = state.load().kernels
        env = record.replicas[0].env
        keys = take_kernel_keys(dict(env))
        assert keys is not None and all(r.env == env for r in record.replicas)
        public, secret = zmq.curve_keypair()
        stranger = CurveKeys(secret, public)
        for replica in record.replicas:
            # The front reaches the replica's Jupyter sockets as a client of the same pair.
            assert replica.connection["curve_publickey"] == keys.public_key.decode()
            assert replica.connection["curve_secretkey"] == keys.secret_key.decode()
            ip = replica.connection["ip"]
            jupyter = [f"tcp://{ip}:{replica.connection[f'{c}_port']}" for c in _ROUTERS]
            for address in [replica.raft, *jupyter]:
                # Even knowing the server's public key, only the kernel's pair gets in.
                server = keys.public_key
                ok = await anyio.to_thread.run_sync(_handshake, address, keys, server)
                assert ok == zmq.EVENT_HANDSHAKE_SUCCEEDED, address
                refused = await anyio.to_thread.run_sync(_handshake, address, stranger, server)
                assert refused == zmq.EVENT_HANDSHAKE_FAILED_AUTH, address
                plain = await anyio.to_thread.run_sync(_handshake, address, None, server)
                assert plain != zmq.EVENT_HANDSHAKE_SUCCEEDED, address
        with anyio.fail_after(DEADLINE):
            refusal = f"refused CURVE client key {public!r}"
            while not await anyio.to_thread.run_sync(_logged, tmp_path / "run", refusal):  # noqa: ASYNC110 (other processes' logs)
                await anyio.sleep(0.2)

        # The kernel went on, and a replacement joins its Raft group over CURVE.
        assert (await kernel.execute("x += 1")).status == "ok"
        node = await kernel.replace_replica(1, timeout=2 * DEADLINE)
        result = await kernel.execute("print(x)")
        assert result.status == "ok" and result.stdout == "42\n"
        [record] = state.load().kernels
        assert node in {r.node for r in record.replicas}
        assert all(r.env == env for r in record.replicas)
        # The front reaches the replacement over CURVE too.
        assert all(
            r.connection["curve_publickey"] == keys.public_key.decode() for r in record.replicas
        )
