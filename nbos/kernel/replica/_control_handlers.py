"""The control requests a replica serves beyond Jupyter's (:mod:`nbos.kernel.protocol`),
and its own interrupt.

The front has a replica commit ``Done(index, lost)`` for a cell whose executor died,
say where the kernel's cells stand (a front taking a kernel over), give its namespace
digest, move GPU tensors to host memory (the host needs the devices) and change the
kernel's Raft membership (replacing a dead replica). An interrupt signals this
process only, and only for the cell it names.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from nbos.core.errors import NbosError
from nbos.core.ids import NodeId
from nbos.core.wire.entries import Done
from nbos.kernel.protocol import (
    CAMPAIGNED,
    CELL_STATUS,
    DIGEST_AFTER,
    DIGEST_REQUEST,
    EVICT_DEVICES,
    EVICT_REQUEST,
    EXECUTION_COUNT,
    GONE_NODE,
    LAST_DONE,
    LEADER_GONE_REQUEST,
    LOST_INDEX,
    LOST_REQUEST,
    MEMBER_REQUEST,
    NEXT_CLAIMED_BY,
    PROGRESS_REQUEST,
    error_content,
    interrupted_cell,
    reply_of,
)
from nbos.kernel.replica._applier import Applier
from nbos.kernel.replica._membership import member_reply

log = logging.getLogger(__name__)


def _node_id(value: object) -> NodeId:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{GONE_NODE!r} must be a node id, not {value!r}")
    return NodeId(value)


class ControlHandlers(Applier):
    """The replica kernel's control handlers (see the module doc)."""

    def _init_control(self) -> None:
        self.control_handlers[LOST_REQUEST] = self._lost_request
        self.control_handlers[DIGEST_REQUEST] = self._digest_request
        self.control_handlers[PROGRESS_REQUEST] = self._progress_request
        self.control_handlers[EVICT_REQUEST] = self._evict_request
        self.control_handlers[MEMBER_REQUEST] = self._member_request
        self.control_handlers[LEADER_GONE_REQUEST] = self._leader_gone_request

    async def _lost_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Commit ``Done(index, lost)`` for a cell whose executor died; reply what counts."""
        assert self._raft is not None
        content: dict[str, Any]
        try:
            index = int(parent["content"][LOST_INDEX])
            done = Done(index, self.node, int(self._shell.execution_count), "lost")
            outcome = await self._raft.propose(done)
            content = {
                "status": "ok",
                CELL_STATUS: outcome.status,
                EXECUTION_COUNT: outcome.execution_count,
            }
        except (KeyError, TypeError, ValueError, NbosError) as exc:
            log.warning("nbos_lost_request failed: %s", exc)
            content = error_content(exc, self.execution_count)
        self._session.send(stream, reply_of(LOST_REQUEST), content, parent, ident=ident)

    async def _leader_gone_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Replica ``node``'s process ended: campaign at once if it was the Raft leader."""
        assert self._raft is not None
        content: dict[str, Any]
        try:
            node = _node_id(parent["content"][GONE_NODE])
            campaigned = await self._raft.campaign_for_dead_leader(node)
            content = {"status": "ok", CAMPAIGNED: campaigned}
        except (KeyError, TypeError, NbosError) as exc:
            log.warning("%s failed: %s", LEADER_GONE_REQUEST, exc)
            content = error_content(exc, self.execution_count)
        self._session.send(stream, reply_of(LEADER_GONE_REQUEST), content, parent, ident=ident)

    async def _progress_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Reply where the kernel's cells stand, as committed when the request came: the
        last ``Done``'s cell and who claimed the cell after it (a front taking over)."""
        assert self._raft is not None and self._machine is not None
        content: dict[str, Any]
        try:
            await self._raft.caught_up()
        except NbosError as exc:
            log.warning("nbos_progress_request failed: %s", exc)
            content = error_content(exc, self.execution_count)
        else:
            done, claimed_by = self._machine.progress()
            content = {"status": "ok", LAST_DONE: done, NEXT_CLAIMED_BY: claimed_by}
        self._session.send(stream, reply_of(PROGRESS_REQUEST), content, parent, ident=ident)

    async def _digest_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Reply the namespace digest once the cell ``after`` (default: none) has applied."""
        assert self._main_loop is not None
        content: dict[str, Any]
        try:
            after = int(parent["content"].get(DIGEST_AFTER, 0))
        except (TypeError, ValueError) as exc:
            log.warning("nbos_digest_request refused: %s", exc)
            content = error_content(exc, self.execution_count)
        else:
            future = asyncio.run_coroutine_threadsafe(self._digest_after(after), self._main_loop)
            digest, done = await asyncio.wrap_future(future)
            content = {"status": "ok", "digest": digest, "applied_done": done}
        self._session.send(stream, reply_of(DIGEST_REQUEST), content, parent, ident=ident)

    async def _digest_after(self, index: int) -> tuple[str, int]:
        await self._wait_done(index)
        assert self._sync is not None
        return self._sync.digest(self._user_state()), self._applied_done

    async def _evict_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Move tensors left resident on GPUs to host memory (the host needs the devices).

        ``devices`` in the content, if given, names the devices the host needs.
        """
        assert self._main_loop is not None
        devices = parent.get("content", {}).get(EVICT_DEVICES)
        needed = (
            tuple(devices)
            if isinstance(devices, list) and all(isinstance(d, int) for d in devices)
            else None
        )
        content: dict[str, Any] = {"status": "ok"}
        # A cell binds all of our tensors onto its own devices: if none of ours is on a
        # needed device, there is nothing to move, and the answer must not wait for the
        # main loop, which a running cell's code may hold for as long as it runs. A cell
        # binding meanwhile binds devices its host committed to it, never needed ones.
        if self._holds(needed):
            future = asyncio.run_coroutine_threadsafe(self._evict(needed), self._main_loop)
            try:
                await asyncio.wrap_future(future)
            except Exception as exc:
                log.exception("eviction failed")
                content = error_content(exc, self.execution_count)
        self._session.send(stream, reply_of(EVICT_REQUEST), content, parent, ident=ident)

    async def _evict(self, needed: tuple[int, ...] | None) -> None:
        # Not while a cell uses the devices: the namespace lock is held during cells.
        async with self._namespace_lock:
            # The cell that held it may have moved them off the needed devices.
            if self._holds(needed):
                await self._binder.evict()

    def _holds(self, needed: tuple[int, ...] | None) -> bool:
        """Whether our tensors may be on ``needed`` devices (``None``: any device)."""
        return needed is None or bool(set(needed) & set(self._binder.resident))

    async def _member_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """Change the kernel's Raft membership (see :func:`member_reply`)."""
        assert self._raft is not None
        content = await member_reply(self._raft, parent["content"])
        self._session.send(stream, reply_of(MEMBER_REQUEST), content, parent, ident=ident)

    async def interrupt_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        # Only this process is signalled: the base class signals the whole process group,
        # which could hold other replicas.
        cell = interrupted_cell(parent.get("metadata"))
        self._interrupts.interrupt(cell, lambda: os.kill(os.getpid(), signal.SIGINT))
        self._session.send(stream, "interrupt_reply", {"status": "ok"}, parent, ident=ident)
