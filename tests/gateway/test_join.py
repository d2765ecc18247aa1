"""Agents that join with a join token: their own key pairs, pinned by the gateway.

A real gateway (in this process) with keys and a join token, and ``nbos agent``
processes given only the token: each makes its own CURVE pair in its state directory,
joins over CURVE, registers and serves a kernel. The gateway pins each host's key, so
an agent restarted on its state directory joins again, while another key for the same
host name, a token with another secret, replayed or stale joins and undecodable bytes
are refused with their reasons, and the agent endpoint still admits no other key.
"""

from __future__ import annotations

import stat
import time
from pathlib import Path

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio
import zmq.auth

from nbos.core.errors import ConfigError
from nbos.core.wire import AnyMessage, decode, encode
from nbos.core.wire.agent import AgentJoin, AgentJoined, JoinRefused
from nbos.gateway.service import GatewayService
from nbos.transport import CurveKeys
from nbos.transport.join import JoinToken, join_proof, make_join_token, new_nonce
from nbos.transport.keys import generate_keys
from nbos.transport.ports import free_loopback_ports
from nbos.transport.zmq import curve_client
from tests.agent._daemons import DEADLINE, AgentProcess, start_agent
from tests.gateway._service import local_settings
from tests.gateway.test_curve import _handshake

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

HOSTS = ("j-1", "j-2", "j-3")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _ask(address: str, token: JoinToken, data: bytes) -> AnyMessage:
    """Send ``data`` to the join endpoint as a CURVE client of a fresh pair; the answer."""
    public, secret = zmq.curve_keypair()
    context = zmq.asyncio.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        curve_client(dealer, CurveKeys(secret, public), token.gateway_public)
        dealer.connect(address)
        await dealer.send(data)
        with anyio.fail_after(DEADLINE):
            return decode(await dealer.recv())
    finally:
        context.destroy(linger=0)


def _join(token: JoinToken, host: str, *, at: float | None = None) -> AgentJoin:
    public, _ = zmq.curve_keypair()
    nonce, now = new_nonce(), time.time() if at is None else at
    proof = join_proof(token, host, public.decode(), nonce, now)
    return AgentJoin(host, public.decode(), nonce, now, proof)


async def _exited(agent: AgentProcess) -> int:
    with anyio.fail_after(DEADLINE):
        while agent.process.poll() is None:  # noqa: ASYNC110 (another process's end: polled)
            await anyio.sleep(0.2)
    return agent.process.returncode


async def test_agents_join_with_their_own_keys_and_the_gateway_pins_them(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    token_file, new = make_join_token(keys)
    assert new and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert make_join_token(keys) == (token_file, False)  # kept: agents holding it still join
    token = JoinToken.read(token_file)
    (join_port,) = free_loopback_ports(1)
    join_at = f"127.0.0.1:{join_port}"
    settings = local_settings(
        tmp_path,
        keys=str(keys),
        join_token_file=str(token_file),
        join_address=join_at,
        local_agents=False,
    )
    gateway = settings.gateway.agent_address
    joining = ["--join-token-file", str(token_file), "--join-address", join_at]
    agents: list[AgentProcess] = []
    try:
        async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
            agents = [start_agent(h, gateway, tmp_path, extra=joining) for h in HOSTS]
            await service.directory.wait_for_hosts(3, timeout=DEADLINE)
            for agent in agents:
                own = agent.state_dir / "keys" / "agent.key_secret"
                assert stat.S_IMODE(own.stat().st_mode) == 0o600
                public, _ = zmq.auth.load_certificate(own)
                pinned, _ = zmq.auth.load_certificate(keys / "hosts" / f"{agent.host}.key")
                assert pinned == public
            kernel = await service.kernel_manager.start_kernel()
            assert (await kernel.execute("x = 41")).status == "ok"

            # Restarted on its state directory, an agent joins again with the same key.
            agents[0].kill()
            agents[0].wait()
            agents[0] = start_agent(HOSTS[0], gateway, tmp_path, extra=joining)
            with anyio.fail_after(DEADLINE):
                while "joined the gateway" not in agents[0].log_text():  # noqa: ASYNC110
                    await anyio.sleep(0.2)
            await service.directory.wait_for_hosts(3, timeout=DEADLINE)
            result = await kernel.execute("print(x + 1)")
            assert (result.status, result.stdout) == ("ok", "42\n")

            # The same host name with another key (another state dir) is refused for good.
            (tmp_path / "other").mkdir()
            impostor = start_agent(HOSTS[1], gateway, tmp_path / "other", extra=joining)
            assert await _exited(impostor) != 0
            assert "another key is pinned for it" in impostor.log_text()
            assert f"delete {keys}/hosts/{HOSTS[1]}.key" in impostor.log_text()

            # A token with this gateway's key but another secret proves nothing.
            forged = tmp_path / "forged.token"
            forged.write_text(JoinToken(token.gateway_public, b"\1" * 32).text())
            extra = ["--join-token-file", str(forged), "--join-address", join_at]
            stranger = start_agent("j-9", gateway, tmp_path, extra=extra)
            assert await _exited(stranger) != 0
            assert "does not match the join token" in stranger.log_text()
            assert not (keys / "hosts" / "j-9.key").exists()

            # A join replayed, a stale one, undecodable bytes: refused, each with its reason.
            address = f"tcp://{join_at}"
            join = encode(_join(token, "j-7"))
            assert isinstance(await _ask(address, token, join), AgentJoined)
            replay = await _ask(address, token, join)
            assert isinstance(replay, JoinRefused) and replay.kind == "replayed"
            stale = await _ask(address, token, encode(_join(token, "j-8", at=time.time() - 3600)))
            assert isinstance(stale, JoinRefused) and stale.kind == "expired"
            junk = await _ask(address, token, b"\x93not msgpack")
            assert isinstance(junk, JoinRefused) and junk.kind == "malformed"
            bad = msgspec.structs.replace(_join(token, "j-6"), public_key="short")
            refused = await _ask(address, token, encode(bad))
            assert isinstance(refused, JoinRefused) and refused.kind == "malformed"

            # The agent endpoint itself admits pinned keys only.
            public, secret = zmq.curve_keypair()
            server = keys / "gateway.key"
            gateway_key, _ = zmq.auth.load_certificate(server)
            outcome = await anyio.to_thread.run_sync(
                _handshake, f"tcp://{gateway}", CurveKeys(secret, public), gateway_key
            )
            assert outcome == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            result = await kernel.execute("print(x + 2)")
            assert (result.status, result.stdout) == ("ok", "43\n")
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()


async def test_a_token_of_another_gateway_or_a_malformed_one_is_refused(tmp_path: Path) -> None:
    keys, other = tmp_path / "keys", tmp_path / "other"
    generate_keys(keys, [])
    token_file, _ = make_join_token(other)
    settings = local_settings(
        tmp_path, keys=str(keys), join_token_file=str(token_file), local_agents=False
    )
    with pytest.raises(ConfigError) as refused:
        async with GatewayService.serve(settings):
            pass
    assert refused.value.key == "gateway.join_token_file"

    for text in ("", "NBOSJ1-short-00", "SWMTKN-1-" + "a" * 100):
        with pytest.raises(ConfigError):
            JoinToken.parse(text)
    # The secret is never shown, parsed or not.
    token = JoinToken.read(token_file)
    assert token.secret.hex() not in repr(token)
    with pytest.raises(ConfigError) as bad:
        JoinToken.parse(token.text()[:-1] + "z")
    assert token.secret.hex()[:-1] not in str(bad.value)
