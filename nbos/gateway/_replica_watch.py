"""What a kernel does when one of its replicas ends, or is only suspected.

An exit is proof: the front stops using the replica, its host frees what it held, and
``after_exit`` deals with it (the kernel restarts it in place if it lost its majority,
else the policy replaces it after ``replace_after_s``). Suspicion (its host fell silent,
or it stopped answering the front's heartbeats) is not: the replica is left running,
and replaced only if it stays suspected for ``replace_suspected_after_s`` while the
others keep a majority; it is stopped once its replacement took its place.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import anyio
import anyio.abc
import attrs

from nbos.core.compute_backend import ProcessHandle
from nbos.gateway._replacement import Replacer
from nbos.kernel.front import KernelFront


@attrs.frozen
class ReplicaWatch:
    """Watches the replicas of one kernel; ``replica_gone(node)`` frees what it held,
    ``after_exit(node, handle)`` brings it back or replaces it."""

    front: KernelFront
    handles: Mapping[int, ProcessHandle]
    replacer: Replacer
    replica_gone: Callable[[int], Awaitable[None]]
    after_exit: Callable[[int, ProcessHandle], Awaitable[None]]
    replace_suspected_after_s: float | None
    tg: anyio.abc.TaskGroup
    #: Set once the kernel's front serves: before, it has not heard from a majority (a
    #: kernel being taken back may have none), and nothing is brought back or replaced.
    serving: anyio.Event = attrs.field(factory=anyio.Event)

    async def watch(self, node: int, handle: ProcessHandle) -> None:
        """Until ``handle`` (replica ``node``) exits, then the exit's consequences."""
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(self._watch_suspicion, node, handle)
            status = await handle.wait()
        self.front.mark_dead(node, f"process exited with status {status}")
        await self.replica_gone(node)
        await self.serving.wait()
        await self.after_exit(node, handle)

    def declared_dead(self, node: int, reason: str) -> None:
        """The front gave up on ``node``: replaced if it stays unresponsive, never killed."""
        handle = self.handles.get(node)
        delay = self.replace_suspected_after_s
        if handle is None or handle.returncode is not None or delay is None:
            return
        if not self.front.is_closing and self.front.unresponsive(node):
            self.tg.start_soon(
                self.replacer.replace_while,
                node,
                handle,
                delay,
                lambda: self.front.unresponsive(node),
            )

    async def _watch_suspicion(self, node: int, handle: ProcessHandle) -> None:
        delay = self.replace_suspected_after_s
        while delay is not None and handle.returncode is None:
            await handle.wait_suspected()
            if await self._serving_unless_ended(handle):
                await self.replacer.replace_while(node, handle, delay, lambda: handle.suspected)
                await anyio.sleep(delay)

    async def _serving_unless_ended(self, handle: ProcessHandle) -> bool:
        """Whether the front serves and ``handle`` runs, once one of the two is decided."""
        async with anyio.create_task_group() as tg:

            async def ended() -> None:
                await handle.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(ended)
            await self.serving.wait()
            tg.cancel_scope.cancel()
        return handle.returncode is None
