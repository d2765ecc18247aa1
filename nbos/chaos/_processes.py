"""The processes of a gateway on this machine: found by their listening ports, stopped
(``SIGSTOP``) and continued (``SIGCONT``), each stop seen in ``/proc``.

A gateway by address is found on this machine by the process listening on its control
port, and a host's agent by the one listening on the address the gateway reports for
it: no record of who started them is needed (``nbos gateway`` by hand, its local
agents, ``nbos cluster up``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import anyio
import attrs

from nbos.core.errors import KernelError
from nbos.gateway.control_api import ClusterStatus, StatusRequest, call

#: How long a ``SIGSTOP`` may take to show as state ``T`` in ``/proc``.
_STOP_SEEN_S = 10.0
_POLL_S = 0.02
#: ``/proc/net/tcp``'s code of a listening socket.
_LISTEN = "0A"


def port_of(address: str) -> int:
    """The port of ``HOST:PORT`` or ``tcp://HOST:PORT``."""
    try:
        return int(address.rsplit(":", 1)[1])
    except (IndexError, ValueError) as exc:
        raise KernelError(f"{address!r} is not HOST:PORT") from exc


def listening_pids(port: int) -> set[int]:
    """The processes of this machine (this network namespace) listening on TCP ``port``."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    pids: set[int] = set()
    if not inodes:
        return pids
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # ended meanwhile, or not ours to read
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                pids.add(int(proc.name))
    return pids


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc`` (``T``: stopped), ``None`` once it ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return None


def group_members(group: int) -> list[int]:
    """The processes of process group ``group`` that have not ended (zombies aside)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # ended meanwhile
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
            if int(fields[2]) == group and fields[0] != "Z":
                found.append(int(proc.name))
    return found


async def stop(pid: int, what: str) -> None:
    """``SIGSTOP`` ``pid`` and return once ``/proc`` shows it stopped."""
    os.kill(pid, signal.SIGSTOP)
    with anyio.move_on_after(_STOP_SEEN_S):
        while process_state(pid) not in ("T", "t"):  # noqa: ASYNC110 (not our child: polled)
            await anyio.sleep(_POLL_S)
        return
    raise KernelError(f"{what} (pid {pid}) did not stop within {_STOP_SEEN_S:g} s")


def cont(pid: int) -> None:
    """``SIGCONT`` ``pid``, if it still runs."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@attrs.frozen
class LocalGateway:
    """The gateway at ``address`` and its agents, as processes of this machine."""

    address: str

    @classmethod
    def find(cls, address: str) -> LocalGateway | None:
        """The gateway at ``address`` if it runs on this machine in a process of its own."""
        gateway = cls(address)
        try:
            gateway.gateway_pid()
        except KernelError:
            return None
        return gateway

    def gateway_pid(self) -> int:
        """The gateway's process: the one listening on its control port."""
        return _one(listening_pids(port_of(self.address)), f"the gateway at {self.address}")

    async def agent_pid(self, host: str) -> int:
        """The process of ``host``'s agent: the one listening on the address the gateway
        reports for the host."""
        status = await call(self.address, StatusRequest(), timeout=30.0)
        if not isinstance(status, ClusterStatus):
            raise KernelError(f"the gateway at {self.address} answered {status!r} to a status")
        reported = next((h.address for h in status.hosts if h.host_id == host), None)
        if reported is None:
            raise KernelError(f"the gateway at {self.address} reports no host {host}")
        return _one(listening_pids(port_of(reported)), f"the agent of {host} ({reported})")


def _one(pids: set[int], what: str) -> int:
    if os.getpid() in pids:
        raise KernelError(f"{what} runs in this process: stopping it would stop the chaos run")
    if len(pids) != 1:
        found = sorted(pids) or "none"
        raise KernelError(f"{what}: one process of this machine must listen there ({found})")
    return pids.pop()
