"""Pieces every backend shares: exit-status normalisation, the handle base, checks."""

from __future__ import annotations

import logging
import re
import signal
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from typing import TypeVar

import anyio

from nbos.core.compute_backend import ProcessHandle, ProcessSpec
from nbos.core.errors import BackendError, HostUnreachableError
from nbos.core.ids import HostId

logger = logging.getLogger(__name__)

H = TypeVar("H", bound=ProcessHandle)

#: The variable every started process finds its host id in.
HOST_ID_ENV = "NBOS_HOST_ID"

# Shells and container runtimes report "killed by signal N" as exit status 128 + N.
_SIGNAL_STATUS_BASE = 128
_MAX_SIGNAL = 64
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")


def normalize_exit_status(status: int) -> int:
    """Map a ``128 + N`` status (container runtimes, shells) to ``-N``, as ``subprocess`` does.

    A process that exits with such a status on purpose is indistinguishable from
    one killed by signal ``N``; nbos processes never do.
    """
    if _SIGNAL_STATUS_BASE < status <= _SIGNAL_STATUS_BASE + _MAX_SIGNAL:
        return -(status - _SIGNAL_STATUS_BASE)
    return status


def check_start(
    backend: str, closed: bool, host: HostId, known: Collection[HostId], spec: ProcessSpec
) -> None:
    """What every backend checks before starting ``spec`` on ``host``.

    Raises :class:`BackendError` once the backend is closed or for a spec no
    backend can start, and :class:`HostUnreachableError` for a host it does not know.
    """
    if closed:
        raise BackendError(f"the {backend} backend is closed")
    _check_host(host, known, backend)
    _check_spec(spec, backend)


def _check_host(host: HostId, known: Collection[HostId], backend: str) -> None:
    if host not in known:
        logger.warning("%s backend: start on unknown host %r (known: %s)", backend, host, known)
        raise HostUnreachableError(host, f"not a host of the {backend} backend")


def _check_spec(spec: ProcessSpec, backend: str) -> None:
    if not spec.argv or not all(isinstance(a, str) and a for a in spec.argv):
        logger.warning("%s backend: refused argv %r", backend, spec.argv)
        raise BackendError(f"argv must be a non-empty list of non-empty strings, got {spec.argv!r}")
    bad = [k for k in spec.env if not _ENV_NAME.fullmatch(k) or "\0" in spec.env[k]]
    if bad:
        logger.warning("%s backend: refused environment names %r", backend, bad)
        raise BackendError(f"bad environment variable names or values: {bad!r}")


def process_env(host: HostId, spec_env: Mapping[str, str]) -> dict[str, str]:
    """The spec's environment plus the host id."""
    return {**spec_env, HOST_ID_ENV: host}


def safe_file_part(text: str) -> str:
    """``text`` made safe as one path component (no separators, no dot-dot)."""
    return _UNSAFE_FILE_CHARS.sub("_", text).strip(".")[:60] or "_"


def log_name(seq: int, spec: ProcessSpec) -> str:
    """A file name for a process's log: a sequence number and its label (or program name)."""
    return f"{seq:04d}-{safe_file_part(spec.label or spec.argv[0].rsplit('/', 1)[-1])}.log"


def with_running(handles: list[H], new: H) -> list[H]:
    """``handles`` less those known to have ended, plus ``new``: keeps the list bounded."""
    return [*(h for h in handles if h.returncode is None), new]


class HandleBase(ABC):
    """What every backend's process handle shares: its host and the terminate sequence."""

    def __init__(self, host: HostId) -> None:
        self._host = host

    @property
    def host(self) -> HostId:
        return self._host

    @property
    @abstractmethod
    def returncode(self) -> int | None: ...

    @abstractmethod
    async def wait(self) -> int: ...

    @abstractmethod
    async def signal(self, signum: int) -> None: ...

    @property
    def suspected(self) -> bool:
        """Never, unless the backend can lose sight of a host (see the agent backend)."""
        return False

    async def wait_suspected(self) -> None:
        """Return once the process ended: a host this backend runs is never suspected."""
        await self.wait()

    async def terminate(self, grace: float = 5.0) -> int:
        """SIGTERM (and SIGCONT, so a stopped process acts on it), then SIGKILL after ``grace``."""
        if self.returncode is not None:
            return self.returncode
        await self.signal(signal.SIGTERM)
        await self.signal(signal.SIGCONT)
        with anyio.move_on_after(max(grace, 0.0)):
            return await self.wait()
        logger.info("process on %s ignored SIGTERM for %.1fs; sending SIGKILL", self.host, grace)
        await self.signal(signal.SIGKILL)
        return await self.wait()
