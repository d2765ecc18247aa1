"""SSH-specific behaviour: vanished hosts, unreachable hosts, host keys, remote logs, config."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from nbos.backends.ssh import SshBackend
from nbos.core.compute_backend import ProcessSpec
from nbos.core.errors import ConfigError, HostUnreachableError
from nbos.core.ids import HostId
from tests._servers._process import serve_or_skip
from tests._servers.sshd import SshServer, start_sshd
from tests.backends._procs import MARKER_ENV, SLEEP, marked_pids, python
from tests.backends._ssh import ssh_target

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

H1 = HostId("h1")


@pytest.fixture
def own_sshd(tmp_path: Path) -> Iterator[SshServer]:
    """A server of this test's own, which the test may make vanish."""
    yield from serve_or_skip(lambda: start_sshd(tmp_path / "sshd"), "a real sshd")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["killed", "frozen"])
async def test_wait_raises_when_the_host_vanishes(own_sshd: SshServer, how: str) -> None:
    # "killed": the TCP connection is reset at once; "frozen": it stays open but silent,
    # so only the keepalives (0.3 s x 2) can tell.
    backend = SshBackend({H1: ssh_target(own_sshd)}, keepalive_interval=0.3, keepalive_count_max=2)
    marker = os.urandom(8).hex()
    handle = await backend.start(H1, ProcessSpec(python(SLEEP), env={MARKER_ENV: marker}))
    try:
        assert own_sshd.session_pids(), "the connection has per-connection sshd processes"
        if how == "killed":
            own_sshd.vanish()
        else:
            for pid in own_sshd.session_pids():
                os.kill(pid, signal.SIGSTOP)
        with anyio.fail_after(20), pytest.raises(HostUnreachableError) as info:
            await handle.wait()
        assert info.value.host == H1
        assert handle.lost
        assert handle.returncode is None
        with pytest.raises(HostUnreachableError):
            await handle.signal(signal.SIGKILL)
        # The process outlives the connection; its fate is the host's business.
        assert handle.pid in marked_pids(marker)
        await backend.aclose()  # logs that it cannot reach it, does not hang
    finally:
        _kill_group(handle.pid)
        await backend.aclose()


async def test_start_on_a_vanished_host_is_unreachable(own_sshd: SshServer) -> None:
    backend = SshBackend({H1: ssh_target(own_sshd)}, connect_timeout=3)
    try:
        handle = await backend.start(H1, ProcessSpec(python("pass")))
        assert await handle.wait() == 0
        own_sshd.vanish()
        with anyio.fail_after(20), pytest.raises(HostUnreachableError):
            await backend.start(H1, ProcessSpec(python("pass")))
    finally:
        await backend.aclose()


async def test_closed_port_is_unreachable(own_sshd: SshServer) -> None:
    own_sshd.stop()
    backend = SshBackend({H1: ssh_target(own_sshd)}, connect_timeout=3)
    with anyio.fail_after(20), pytest.raises(HostUnreachableError):
        await backend.start(H1, ProcessSpec(python("pass")))
    await backend.aclose()


async def test_unknown_host_key_is_refused(sshd_server: SshServer, tmp_path: Path) -> None:
    other = tmp_path / "known_hosts"
    other.write_text(
        f"[127.0.0.1]:{sshd_server.port} ssh-ed25519 "
        "AAAAC3NzaC1lZDI1NTE5AAAAIGyo2MK+FjTLUuoYvUi4s8DXlrpQfRvhpcaPaOJ9nRLZ\n"
    )
    backend = SshBackend({H1: ssh_target(sshd_server, known_hosts=other)}, connect_timeout=3)
    with pytest.raises(HostUnreachableError, match="h1"):
        await backend.start(H1, ProcessSpec(python("pass")))
    await backend.aclose()


async def test_output_goes_to_the_remote_log(sshd_server: SshServer, tmp_path: Path) -> None:
    backend = SshBackend({H1: ssh_target(sshd_server)}, remote_log_dir=str(tmp_path / "logs"))
    try:
        code = "import sys; print('to out', flush=True); print('to err', file=sys.stderr)"
        handle = await backend.start(H1, ProcessSpec(python(code), label="talker"))
        assert await handle.wait() == 0
        log = Path(handle.log_path)
        assert log.parent == tmp_path / "logs" / "h1"
        assert log.name.endswith("-talker.log")
        assert (await anyio.Path(log).read_text()).splitlines() == ["to out", "to err"]
    finally:
        await backend.aclose()


def test_hosts_can_be_given_as_config_mappings(tmp_path: Path) -> None:
    backend = SshBackend({"a": {"address": "gpu-1", "port": 2222, "key_file": "~/k"}})
    assert backend.hosts() == ("a",)
    with pytest.raises(ConfigError, match=r"hosts\.b"):
        SshBackend({"b": {"address": "gpu-2", "colour": "blue"}})
    with pytest.raises(ConfigError):
        SshBackend({})
