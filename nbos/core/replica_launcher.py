"""The ``ReplicaLauncher`` interface: where the gateway starts a kernel's replicas.

A launcher starts replica processes on hosts, hands out addresses free there and reads
back where a started replica's kernel listens. The gateway's are
``nbos.gateway.AgentBackend`` (hosts are ``nbos agent`` daemons) and
``nbos.gateway.LocalLauncher`` (virtual hosts on this machine).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from nbos.core.compute_backend import ProcessHandle, ProcessSpec
from nbos.core.ids import HostId
from nbos.core.wire.agent import ReplicaOwner


class ReplicaLauncher(Protocol):
    """Starts replica processes on hosts and finds out where clients reach them."""

    def ip(self, host: HostId) -> str:
        """The address ``host`` is reached at (its replicas bind it)."""
        ...

    def virtual_gpus(self, host: HostId) -> bool:
        """Whether ``host``'s GPUs are virtual (replicas keep "GPU" tensors in host memory)."""
        ...

    async def addresses(self, host: HostId, count: int) -> list[str]:
        """``count`` ``tcp://IP:PORT`` addresses free on ``host``, never handed out before."""
        ...

    async def start_replica(
        self,
        host: HostId,
        spec: ProcessSpec,
        *,
        workdir: str,
        connection_key: str,
        owner: ReplicaOwner | None = None,
    ) -> ProcessHandle:
        """Start ``spec`` on ``host`` with a working directory ``workdir`` (kept across
        restarts) holding a connection file seeded with the host's address and the key.
        ``owner``: whose replica it is, kept with it where replicas outlive the gateway
        (an :class:`AdoptingLauncher`'s), for a later gateway to decide on it by."""
        ...

    async def connection_info(self, handle: ProcessHandle, timeout: float) -> Mapping[str, Any]:
        """The replica's connection info once its kernel bound its ports.

        Raises :class:`~nbos.core.errors.BackendError` if it ended first or ``timeout`` passed.
        """
        ...


@runtime_checkable
class AdoptingLauncher(ReplicaLauncher, Protocol):
    """A launcher whose replicas outlive the gateway, which a restarted one takes back."""

    def process_id(self, handle: ProcessHandle) -> str:
        """What names ``handle``'s process to :meth:`adopt` in a later gateway."""
        ...

    async def adopt(self, host: HostId, process_id: str, timeout: float) -> ProcessHandle:
        """A handle on ``process_id`` of ``host``, waiting up to ``timeout`` for the host;
        a handle that has ended already if the process did or the host did not come."""
        ...
