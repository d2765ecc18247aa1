"""A kernel's start asks for its three replicas at once, and a failed one stops the others."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

import nbos
from nbos.core.compute_backend import ProcessHandle, ProcessSpec
from nbos.core.errors import BackendError
from nbos.core.ids import HostId
from nbos.gateway import LocalLauncher

pytestmark = pytest.mark.anyio


class WatchedLauncher:
    """The cluster's own launcher, watched: the most replica starts it ran at once and
    the processes it started; starts on ``failing`` fail (after the others began)."""

    def __init__(self, launcher: LocalLauncher, failing: HostId | None = None) -> None:
        self._launcher = launcher
        self._failing = failing
        self._running = 0
        self.most_at_once = 0
        self.started: list[ProcessHandle] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._launcher, name)

    async def start_replica(self, host: HostId, spec: ProcessSpec, **kw: Any) -> ProcessHandle:
        self._running += 1
        self.most_at_once = max(self.most_at_once, self._running)
        try:
            await anyio.lowlevel.checkpoint()  # the others' turn to begin, if at once
            if host == self._failing:
                raise BackendError(f"{host} refuses replicas (the test's)")
            handle = await self._launcher.start_replica(host, spec, **kw)
        finally:
            self._running -= 1
        self.started.append(handle)
        return handle


async def test_a_start_asks_its_three_hosts_at_once() -> None:
    # One after another, a burst of starts spent three agent round trips per step.
    async with nbos.LocalCluster(hosts=3, durable=False) as cluster:
        manager = cluster.kernel_manager
        watched = WatchedLauncher(manager.launcher)  # type: ignore[arg-type]
        manager.launcher = watched  # type: ignore[assignment]
        with anyio.fail_after(120):
            kernel = await cluster.start_kernel()
        assert watched.most_at_once == 3
        assert (await kernel.execute("print(6 * 7)")).stdout == "42\n"


async def test_a_replica_that_fails_to_start_takes_the_others_started_with_it_down() -> None:
    async with nbos.LocalCluster(hosts=3, durable=False) as cluster:
        manager = cluster.kernel_manager
        watched = WatchedLauncher(manager.launcher, failing=HostId("host-2"))  # type: ignore[arg-type]
        manager.launcher = watched  # type: ignore[assignment]
        with anyio.fail_after(120), pytest.raises(BackendError, match="host-2 refuses"):
            await cluster.start_kernel()
        # The other two did start (at once with the failed one), and no replica outlives
        # the start that failed.
        assert len(watched.started) == 2
        assert all(handle.returncode is not None for handle in watched.started)
        assert cluster.kernels == () and manager.admission.running == 0
