"""The control API's early-answered starts (``StartKernel(early=True)``).

Such a start is answered as soon as it waits for a host the autoscaler adds (as ``POST
/api/kernels`` is), and goes on in the gateway's task group: :class:`ControlStarts` keeps
it until its kernel runs, so that a :class:`~nbos.gateway.control_api.WatchKernel` waits
for it, a ``ShutdownKernel`` calls it off, and a start that failed tells the client that
watches it why (for :data:`FAILED_KEPT_S`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import attrs

from nbos.core.errors import KernelError, NbosError
from nbos.core.identity import User
from nbos.core.ids import KernelId, new_kernel_id
from nbos.gateway._kernel import Kernel
from nbos.gateway._kernel_manager import KernelManager, StartUnderWay
from nbos.gateway._leases import KernelLeases
from nbos.gateway.control_api import KernelInfo

log = logging.getLogger(__name__)

#: How long the error of a start that failed after it was answered is kept for the client
#: that watches it (then its id is unknown, as any other).
FAILED_KEPT_S = 600.0


@attrs.define
class _EarlyStart:
    kernel_id: KernelId
    owner: str
    ended: anyio.Event = attrs.Factory(anyio.Event)
    #: Why it failed, once it did.
    error: Exception | None = None
    #: When it ended (monotonic seconds).
    ended_at: float | None = None
    #: Its scope, to call it off while it waits for a host.
    scope: anyio.CancelScope | None = None
    #: A shutdown was asked while it started: its kernel is shut down once it runs.
    shut_down: bool = False
    #: Answered before it ended (it waited for a host).
    answered: bool = False


class ControlStarts:
    """The starts answered before their kernel runs, by kernel id, until they ended."""

    def __init__(
        self, kernel_manager: KernelManager, leases: KernelLeases, tg: anyio.abc.TaskGroup
    ) -> None:
        self._kernel_manager = kernel_manager
        self._leases = leases
        self._tg = tg
        self._starts: dict[KernelId, _EarlyStart] = {}

    async def start(
        self,
        *,
        gpus: int,
        connection: Mapping[str, Any] | None,
        lease_s: float | None,
        owner: str,
    ) -> Kernel | StartUnderWay:
        """Start a kernel for ``owner``: the kernel once it runs, or the start if it waits
        for a host first (it goes on); the start's error if it fails before either."""
        self._forget_old()
        kernel_id = new_kernel_id()
        early = self._starts[kernel_id] = _EarlyStart(kernel_id, owner)
        answered = anyio.Event()

        def waits(_why: str) -> None:
            early.answered = True
            answered.set()

        self._tg.start_soon(self._run, early, gpus, connection, lease_s, waits)
        async with anyio.create_task_group() as tg:
            for event in (early.ended, answered):
                tg.start_soon(_then_cancel, event, tg.cancel_scope)
        if early.error is not None:
            del self._starts[kernel_id]
            raise early.error
        if early.ended.is_set():
            return self._kernel_manager.kernel(kernel_id)
        return self._under_way(kernel_id)

    async def watch(self, user: User, kernel_id: str, wait_s: float) -> StartUnderWay | None:
        """``None`` unless ``kernel_id`` is an early start of ``user``'s (an admin: anyone's)
        that has not run yet; then, after waiting up to ``wait_s`` for it to end: ``None``
        once it runs, the start while it still starts, and its error if it failed."""
        early = self._starts.get(KernelId(kernel_id))
        if early is None or not user.may_see(early.owner):
            return None
        with anyio.move_on_after(wait_s):
            await early.ended.wait()
        if early.error is not None:
            raise early.error
        return None if early.ended.is_set() else self._under_way(early.kernel_id)

    def shut_down(self, user: User, kernel_id: str) -> bool:
        """Call off ``user``'s early start ``kernel_id`` if it has not run yet (one placed
        already is shut down once it runs); whether there was such a start."""
        early = self._starts.get(KernelId(kernel_id))
        if early is None or early.ended.is_set() or not user.may_see(early.owner):
            return False
        early.shut_down = True
        if early.scope is not None and early.kernel_id in self._kernel_manager.starts_waiting:
            early.scope.cancel()
        log.info("kernel %s shut down while it started", kernel_id)
        return True

    def _under_way(self, kernel_id: KernelId) -> StartUnderWay:
        # The kernel manager's record goes in the same step as the start ends.
        start = self._kernel_manager.start_under_way(kernel_id)
        assert start is not None, f"start {kernel_id} neither ended nor under way"
        return start

    async def _run(
        self,
        early: _EarlyStart,
        gpus: int,
        connection: Mapping[str, Any] | None,
        lease_s: float | None,
        waits: Callable[[str], None],
    ) -> None:
        kernel: Kernel | None = None
        try:
            with anyio.CancelScope() as early.scope:
                kernel = await self._kernel_manager.start_kernel(
                    gpus=gpus,
                    connection=connection,
                    owner=early.owner,
                    kernel_id=early.kernel_id,
                    on_wait=waits,
                )
            if kernel is None:
                early.error = KernelError(f"kernel {early.kernel_id} was shut down as it started")
        except NbosError as exc:
            early.error = exc
            if early.answered:  # else its refusal is the answer, logged where refused
                log.warning("kernel %s did not start: %s", early.kernel_id, exc)
        finally:
            early.ended_at = time.monotonic()
            early.ended.set()
        if kernel is None:
            return
        del self._starts[early.kernel_id]  # its kernel answers for it from now on
        if not early.shut_down:
            if lease_s is not None:
                self._leases.grant(early.kernel_id, lease_s)
            return
        try:
            await kernel.retire()
            await kernel.shutdown()
        except NbosError as exc:  # e.g. a shutdown its state file could not record
            log.warning("kernel %s, shut down as it started, runs on: %s", kernel.kernel_id, exc)

    def _forget_old(self) -> None:
        """Drop the failed starts whose error was kept long enough."""
        now = time.monotonic()
        for kernel_id, early in list(self._starts.items()):
            if early.ended_at is not None and now - early.ended_at > FAILED_KEPT_S:
                del self._starts[kernel_id]


def starting_info(start: StartUnderWay) -> KernelInfo:
    """A start under way as the control API reports a kernel: ``starting``, no front nor
    replicas yet, and why it waits while it waits for a host."""
    return KernelInfo(
        start.kernel_id,
        {},
        [],
        state="starting",
        owner=start.owner,
        gpus=start.gpus,
        started_at=start.asked_at,
        waiting=start.waiting,
    )


async def _then_cancel(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
