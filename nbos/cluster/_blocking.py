"""A blocking facade over :class:`LocalCluster` for scripts: the event loop runs in a thread.

::

    with nbos.connect_blocking(hosts=3) as cluster:
        kernel = cluster.start_kernel()
        print(kernel.execute("1 + 1").outputs)
"""

from __future__ import annotations

import signal
from contextlib import AbstractContextManager, ExitStack
from types import TracebackType
from typing import Any

import anyio.from_thread
from jupyter_client.connect import KernelConnectionInfo

from nbos.cluster._local import LocalCluster
from nbos.gateway import Kernel, ReplicaInfo
from nbos.kernel.client import ExecuteResult


class BlockingKernel:
    """:class:`Kernel` with blocking methods."""

    def __init__(self, kernel: Kernel, portal: anyio.from_thread.BlockingPortal) -> None:
        self._kernel = kernel
        self._portal = portal

    @property
    def kernel_id(self) -> str:
        return self._kernel.kernel_id

    @property
    def connection_info(self) -> KernelConnectionInfo:
        return self._kernel.connection_info

    @property
    def replicas(self) -> tuple[ReplicaInfo, ...]:
        return self._kernel.replicas

    def execute(self, code: str, *, timeout: float = 600.0) -> ExecuteResult:
        return self._portal.call(lambda: self._kernel.execute(code, timeout=timeout))

    def digests(self, *, after: int | None = None) -> dict[int, str]:
        return self._portal.call(lambda: self._kernel.digests(after=after))

    def kill_replica(self, node: int, signum: int = signal.SIGKILL) -> None:
        self._portal.call(self._kernel.kill_replica, node, signum)

    def replace_replica(self, node: int, *, timeout: float = 60.0) -> int:
        return self._portal.call(lambda: self._kernel.replace_replica(node, timeout=timeout))

    def shutdown(self) -> None:
        self._portal.call(self._kernel.shutdown)


class BlockingLocalCluster:
    """:class:`LocalCluster` for synchronous code; a context manager taking the same arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._cluster = LocalCluster(*args, **kwargs)
        self._stack: ExitStack | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None

    def __enter__(self) -> BlockingLocalCluster:
        with ExitStack() as stack:
            portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] = (
                anyio.from_thread.start_blocking_portal("asyncio")
            )
            self._portal = stack.enter_context(portal_cm)
            stack.enter_context(self._portal.wrap_async_context_manager(self._cluster))
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._stack is not None
        stack, self._stack = self._stack, None
        return stack.__exit__(exc_type, exc, tb)

    def start_kernel(self, *, gpus: int = 0) -> BlockingKernel:
        """Start a kernel whose cells ask for ``gpus`` GPUs unless they say otherwise."""
        assert self._portal is not None, "use BlockingLocalCluster in a with block"
        cluster = self._cluster
        return BlockingKernel(
            self._portal.call(lambda: cluster.start_kernel(gpus=gpus)), self._portal
        )


def connect_blocking(hosts: int = 3, **kwargs: Any) -> BlockingLocalCluster:
    """A :class:`BlockingLocalCluster` of ``hosts`` virtual hosts (use it in a ``with``)."""
    return BlockingLocalCluster(hosts, **kwargs)
