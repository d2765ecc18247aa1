"""The ``ComputeBackend`` interface: where replica and agent processes run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from nbos.core.ids import HostId


@attrs.frozen
class ProcessSpec:
    """A process to start on a host: the argv, extra environment and a label for logs."""

    argv: Sequence[str]
    env: Mapping[str, str] = attrs.field(factory=dict)
    label: str = ""


@runtime_checkable
class ProcessHandle(Protocol):
    """A process a backend started. Its methods never raise for a process that already ended."""

    @property
    def host(self) -> HostId:
        """The host it runs on."""
        ...

    @property
    def returncode(self) -> int | None:
        """Exit status once it ended, else ``None``."""
        ...

    async def wait(self) -> int:
        """Wait for the process to end; returns its exit status."""
        ...

    @property
    def suspected(self) -> bool:
        """Whether its host is suspected (silent): the process may run on there, cut off."""
        ...

    async def wait_suspected(self) -> None:
        """Return once the process is suspected with its host, or has ended."""
        ...

    async def signal(self, signum: int) -> None:
        """Send a signal (SIGKILL, SIGSTOP, SIGCONT, SIGINT ...)."""
        ...

    async def terminate(self, grace: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``grace`` seconds; returns the exit status."""
        ...


@runtime_checkable
class ComputeBackend(Protocol):
    """Starts processes on hosts: local processes, Docker containers, SSH hosts.

    ``start`` raises :class:`~nbos.core.errors.HostUnreachableError` when the host
    cannot be reached and :class:`~nbos.core.errors.BackendError` when the process
    cannot be started. Cancelling ``start`` leaves no process running.
    """

    @property
    def name(self) -> str:
        """The backend's registered name (``local``, ``docker``, ``ssh``)."""
        ...

    def hosts(self) -> Sequence[HostId]:
        """The hosts this backend can start processes on."""
        ...

    async def start(self, host: HostId, spec: ProcessSpec) -> ProcessHandle:
        """Start ``spec`` on ``host``."""
        ...

    async def aclose(self) -> None:
        """Stop every process this backend started and release its resources."""
        ...
