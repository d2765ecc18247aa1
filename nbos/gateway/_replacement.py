"""Replacing a kernel's dead replica by a new one on another host.

Not in the paper: there a kernel lives on with two replicas until one comes back. Here
the dead member's place is taken by a new Raft member (a new node id), in this order:

1. the old replica's process is left alone: it may be only frozen, slow or cut off (the
   front has left it out then), or alive and moved (a migration), and it holds the
   kernel's state until its place is taken;
2. a new replica process starts, empty and in ``--join`` mode, on the given host (a
   migration's target) or else on one the placement policy picks among those that hold
   none of the kernel's live replicas;
3. the Raft leader adds it as a learner (its Raft address goes through the log, so
   every member, and any later leader, reaches it); it catches up
   from a snapshot plus the log, i.e. the namespace image and the deltas after it;
4. it is promoted to voter once the leader finds it caught up, then the dead member is
   removed: one membership change at a time, each retried until the Raft core takes it;
   the removal goes to the new voter too, which may have won an election meanwhile;
5. once it applied the kernel's latest ``Done``, the front forgets the dead replica and
   lets cells go to the new one;
6. the old process, no longer a member (that is the proof), is stopped; on a host that
   cannot be reached, once the host is back.

The policy replaces a replica whose process exited, and one that is only suspected
(it stopped answering heartbeats, or its host stopped answering) if it still is after
a delay; either only while the kernel's other replicas keep a majority, so a
membership change can commit. No replica is stopped before its place is taken.

Membership requests reach the leader through the front's control channel to a live
replica (``nbos_member_request``); a follower answers with the leader it knows of.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import anyio
import attrs

from nbos.core.compute_backend import ProcessHandle
from nbos.core.errors import KernelError, NbosError, ReplacementError, ReplicationError
from nbos.core.ids import HostId, KernelId
from nbos.kernel.front import KernelFront, ReplicaEndpoint
from nbos.metrics import ClusterEvent, EventKind, events

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT_S = 5.0
# How long stopping a removed replica may hold a replacement up (its agent retries on).
_STOP_TIMEOUT_S = 30.0
#: How the event log tells each kind of move.
_MOVED = {"replacement": "was replaced by", "migration": "migrated to"}
#: How long an abandoned replacement's removal from the membership may take (a loaded host).
_ABANDON_TIMEOUT_S = 30.0
#: Between tries at a membership change the leader refused for now (a learner catching up:
#: tens to hundreds of milliseconds), or while the group has no leader. A try is one small
#: message to one replica: frequent tries cost little, and a long wait adds to a move.
_BACKOFF_START_S = 0.01
_BACKOFF_MAX_S = 0.1
#: The policy's attempts at replacing one dead replica, and the waits between them
#: (doubling): a replacement that failed for want of a majority takes once one is back.
POLICY_ATTEMPTS = 6
POLICY_BACKOFF_S = (1.0, 16.0)


@attrs.frozen
class Spawned:
    """A replacement replica process that is up: its handle and Jupyter connection info."""

    handle: ProcessHandle
    connection: Mapping[str, Any]


class Spawn(Protocol):
    """Starts replica ``node`` on ``host`` in join mode; ``peers`` (their Raft addresses)
    includes itself."""

    def __call__(self, node: int, host: HostId, peers: Mapping[int, str]) -> Awaitable[Spawned]: ...


#: Picks a host for a replacement of ``kernel``'s replica, avoiding ``exclude``.
Place = Callable[[KernelId, frozenset[HostId]], HostId]


@runtime_checkable
class ReplacementListener(Protocol):
    """Told when a replica was replaced (an executor chooser that tracks replica hosts)."""

    def replica_replaced(self, dead: int, node: int, host: HostId) -> None:
        """Replica ``dead`` is gone for good; ``node`` on ``host`` took its place."""
        ...


@runtime_checkable
class MoveListener(Protocol):
    """Told where a replacement goes before it starts there, and if it failed (the
    scheduler's placement, so that a host about to receive a replica is not taken for
    an empty one: drained, or its GPUs promised elsewhere)."""

    def replica_moving(self, dead: int, host: HostId) -> None:
        """Replica ``dead``'s replacement is starting on ``host``."""
        ...

    def replica_not_moved(self, dead: int, host: HostId) -> None:
        """The replacement of ``dead`` on ``host`` was abandoned."""
        ...


class Replacer:
    """Replaces dead replicas of one kernel, one at a time.

    ``processes`` and ``members`` (their Raft addresses) are the kernel's live
    bookkeeping, shared with the cluster: a replacement adds the new node to both and
    drops the dead one.
    """

    def __init__(
        self,
        *,
        kernel_id: KernelId,
        front: KernelFront,
        processes: dict[int, ProcessHandle],
        members: dict[int, str],
        spawn: Spawn,
        place: Place,
        new_member: Callable[[HostId], Awaitable[str]],
        listeners: Sequence[object] = (),
    ) -> None:
        # Those of ``listeners`` that are ReplacementListeners hear of each replacement,
        # MoveListeners of each one's start and failure.
        self._kernel_id = kernel_id
        self._front = front
        self._processes = processes
        self._members = members
        self._spawn = spawn
        self._place = place
        self._new_member = new_member
        self._listeners = [x for x in listeners if isinstance(x, ReplacementListener)]
        self._movers = [x for x in listeners if isinstance(x, MoveListener)]
        self._lock = anyio.Lock()
        self._scopes: set[anyio.CancelScope] = set()
        self._closed = False
        self._replacing: int | None = None
        # Replicas the policy is about to replace (see replace_while).
        self._pending: set[int] = set()
        #: The replica being replaced was dead (not a live one moved: a migration).
        self._replacing_dead = False
        self._last_node = max(members, default=0)
        #: Dead replicas the policy gave up on, with why.
        self.failures: dict[int, ReplacementError] = {}
        #: The new replica joining now (a Raft learner catching up), and its host.
        self.joining: tuple[int, HostId] | None = None
        #: The replica that last made a membership change, or that a follower named as
        #: its leader: asked first next time (``None``: unknown).
        self._leader: int | None = None

    async def replace(
        self,
        dead: int,
        *,
        timeout: float = 60.0,
        target: HostId | None = None,
        after: int | None = None,
        exited: ProcessHandle | None = None,
    ) -> int:
        """Replace replica ``dead``, stopped once its place is taken; the new node id.

        ``target`` is the new replica's host (a migration), else the placement policy
        picks one. Cells go to the new replica once it applied cell ``after`` (default:
        the kernel's latest settled one, not a cell running meanwhile: the replacement
        does not wait for it; a migration for a waiting cell passes the one before it).
        Raises :class:`KernelError` if ``dead`` is not a replica of the kernel, no
        host can take the replacement, ``target`` holds a live replica, or it did not
        join within ``timeout`` seconds, or if ``exited`` (the policy's) is no longer its
        process: it was restarted in place meanwhile.
        """
        async with self._lock:
            if dead not in self._processes:
                raise KernelError(f"kernel {self._kernel_id} has no replica {dead}")
            if exited is not None and self._processes[dead] is not exited:
                raise KernelError(f"replica {dead} of kernel {self._kernel_id} was restarted")
            if self._closed:
                raise KernelError(f"kernel {self._kernel_id} is shutting down")
            try:
                with anyio.fail_after(timeout), anyio.CancelScope() as scope:
                    self._scopes.add(scope)
                    self._replacing = dead
                    self._replacing_dead = dead not in self._front.alive
                    try:
                        return await self._replace(dead, target, after)
                    finally:
                        self._scopes.discard(scope)
                        self._replacing = None
                raise KernelError(f"kernel {self._kernel_id} shut down during a replacement")
            except TimeoutError:
                raise KernelError(
                    f"kernel {self._kernel_id}: replica {dead} not replaced within {timeout} s"
                ) from None

    async def replace_after_exit(self, node: int, handle: ProcessHandle, delay: float) -> None:
        """The policy: ``handle`` (replica ``node``) exited; replace it after ``delay`` s."""
        await self.replace_while(node, handle, delay, lambda: True)

    async def replace_while(
        self, node: int, handle: ProcessHandle, delay: float, unwell: Callable[[], bool]
    ) -> None:
        """The policy: replace replica ``node`` (``handle``) if ``unwell()`` still holds
        after ``delay`` s and at each attempt.

        Not when it was restarted in place or replaced meanwhile, nor while the kernel
        shuts down, nor twice at once. A failed replacement is logged and retried with
        backoff, up to :data:`POLICY_ATTEMPTS` attempts; then a :class:`ReplacementError`
        is logged and kept in :attr:`failures`: the kernel goes on with the others.
        """
        if node in self._pending:
            return
        self._pending.add(node)
        try:
            await anyio.sleep(delay)
            await self._attempts(node, handle, unwell)
        finally:
            self._pending.discard(node)

    async def _attempts(self, node: int, handle: ProcessHandle, unwell: Callable[[], bool]) -> None:
        backoff, most = POLICY_BACKOFF_S
        why = ""
        for attempt in range(1, POLICY_ATTEMPTS + 1):
            if attempt > 1:
                log.warning(
                    "kernel %s: replica %d not replaced (attempt %d of %d, next in %.0f s): %s",
                    self._kernel_id,
                    node,
                    attempt - 1,
                    POLICY_ATTEMPTS,
                    backoff,
                    why,
                )
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, most)
            if self._processes.get(node) is not handle or self._kernel_ending() or not unwell():
                return
            try:
                await self.replace(node, exited=handle)
            except NbosError as exc:
                if self._kernel_ending() or self._processes.get(node) is not handle:
                    # No replica of it is wanted any more, or another replacement (a
                    # migration, a drain) replaced it meanwhile, or it was restarted in place.
                    return
                why = str(exc)
            except Exception:
                # A background policy: whatever went wrong, the kernel and the cluster go on.
                log.exception("kernel %s: replacing replica %d failed", self._kernel_id, node)
                return
            else:
                return
        error = ReplacementError(self._kernel_id, node, POLICY_ATTEMPTS, why)
        log.error("%s", error)
        self.failures[node] = error

    def _kernel_ending(self) -> bool:
        return self._closed or self._front.is_closing

    async def restart(
        self, node: int, start: Callable[[ProcessHandle], Awaitable[ProcessHandle]]
    ) -> ProcessHandle:
        """Replica ``node``, whose process ended, again: ``start(ended)`` gives its new
        process, which takes the old one's place. Never during a replacement of it.
        Raises :class:`KernelError` if ``node`` is not a replica of the kernel (any more),
        or its process still runs.
        """
        async with self._lock:
            ended = self._processes.get(node)
            if ended is None:
                raise KernelError(f"kernel {self._kernel_id} has no replica {node}")
            if ended.returncode is None:
                raise KernelError(f"replica {node} of kernel {self._kernel_id} is still running")
            handle = self._processes[node] = await start(ended)
            return handle

    def replacing(self, node: int) -> bool:
        """Whether replica ``node`` is being replaced right now."""
        return self._replacing == node

    @property
    def recovering(self) -> bool:
        """Whether a dead replica is being replaced (a migration moves a live one)."""
        return self._replacing is not None and self._replacing_dead

    def close(self) -> None:
        """The kernel shuts down: stop replacements under way and start no more."""
        self._closed = True
        for scope in self._scopes:
            scope.cancel()

    async def _replace(self, dead: int, target: HostId | None, after: int | None) -> int:
        if target is not None and target in {self._processes[n].host for n in self._front.alive}:
            raise KernelError(f"kernel {self._kernel_id} has a live replica on {target}")
        live = [n for n in self._front.alive if n != dead]
        if len(live) * 2 <= len(self._members):
            # Without a majority of the membership no change can commit.
            raise KernelError(f"kernel {self._kernel_id}: only replicas {live} are alive")
        try:
            return await self._take_place(dead, live, target, after)
        except BaseException:
            self._readmit(dead)
            raise

    async def _take_place(
        self, dead: int, live: list[int], target: HostId | None, after: int | None
    ) -> int:
        # A live old replica (a migration's) is a member still, the leader maybe: the
        # changes are asked of it too until it is removed.
        reach = [*live, dead] if dead in self._front.alive else live
        node = await self._fresh_node(reach)
        host = target if target is not None else self._pick_host(dead, live)
        # Ports on the host that will run it: only its own host knows which are free.
        address = await self._new_member(host)
        log.info("kernel %s: replacing replica %d by %d on %s", self._kernel_id, dead, node, host)
        # Every member's address, the old one's too: until it is removed it may be the
        # leader that catches the new one up (a live replica moved by a migration).
        peers = {**self._members, node: address}
        for mover in self._movers:
            mover.replica_moving(dead, host)
        try:
            spawned = await self._spawn(node, host, peers)
            self.joining = (node, host)
            try:
                await self._join(node, address, spawned, reach, after)
                # A voter now, the new replica may have won an election: ask it too.
                await self._change([*reach, node], "remove", dead)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._abandon(node, spawned.handle)
                raise
            finally:
                self.joining = None
        except BaseException:
            for mover in self._movers:
                mover.replica_not_moved(dead, host)
            raise
        self.failures.pop(dead, None)
        for listener in self._listeners:
            listener.replica_replaced(dead, node, host)
        self._front.activate_replica(node)
        old = self._processes.pop(dead)
        self._members.pop(dead, None)
        self._processes[node] = spawned.handle
        self._members[node] = address
        log.info("kernel %s: replica %d replaced by %d", self._kernel_id, dead, node)
        kind: EventKind = "replacement" if target is None else "migration"
        events().happened(
            ClusterEvent(
                kind,
                f"kernel {self._kernel_id}: replica {dead} on {old.host} {_MOVED[kind]} "
                f"replica {node} on {host}",
                kernel=self._kernel_id,
                host=host,
            )
        )
        # Stopped before the front gives up what it ran: a cell it was running is
        # reported lost only once it can no longer finish it.
        await self._stop_removed(dead, old)
        self._front.remove_replica(dead)
        return node

    async def _fresh_node(self, live: Sequence[int]) -> int:
        """A node id the kernel's Raft group never had, once members the kernel does not
        know of are removed: a gateway stopped mid-replacement added them (its record
        never held them, and its next start stopped their processes)."""
        answer = await self._change(live, "members", 0)
        found = {int(n) for n in (*answer.get("voters", ()), *answer.get("learners", ()))}
        for stray in sorted(found - set(self._members)):
            log.warning("kernel %s: removing Raft member %d, unknown to it", self._kernel_id, stray)
            await self._change(live, "remove", stray)
        self._last_node = max(self._last_node, *found) + 1
        return self._last_node

    def _readmit(self, dead: int) -> None:
        """The replacement failed: a replica whose process runs is used again if it answers."""
        handle = self._processes.get(dead)
        if handle is not None and handle.returncode is None and not self._kernel_ending():
            self._front.suspect(dead, "its replacement failed")

    async def _stop_removed(self, dead: int, handle: ProcessHandle) -> None:
        # No longer a member, it can neither vote nor have a cell committed: it goes.
        if handle.returncode is not None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(_STOP_TIMEOUT_S):
            try:
                await handle.terminate(grace=1.0)
            except NbosError as exc:
                log.warning(
                    "kernel %s: removed replica %d not stopped: %s", self._kernel_id, dead, exc
                )

    def _pick_host(self, dead: int, live: Sequence[int]) -> HostId:
        live_hosts = frozenset(self._processes[n].host for n in live)
        dead_host = frozenset({self._processes[dead].host})
        try:
            # Rather not the dead replica's host: whatever killed it may strike again.
            return self._place(self._kernel_id, live_hosts | dead_host)
        except NbosError:
            return self._place(self._kernel_id, live_hosts)

    async def _join(
        self,
        node: int,
        address: str,
        spawned: Spawned,
        live: list[int],
        after: int | None,
    ) -> None:
        await self._change(live, "add_learner", node, address)
        # The leader catches it up meanwhile. Reached first, a new replica that does not
        # answer is abandoned as a learner, not as a voter counted in the majority.
        await self._front.add_replica(ReplicaEndpoint(node, spawned.connection))
        # The Raft core refuses to promote a learner that has not caught up: retried.
        await self._change(live, "promote", node)
        # Cells go to it only once it applied the kernel's latest Done. Applying takes
        # as long as the state is large and the host busy: the replacement's own
        # deadline bounds it, not a limit of its own.
        reply = await self._front.control_request(
            node,
            "nbos_digest_request",
            {"after": self._front.settled_exec_index if after is None else after},
            timeout=math.inf,
        )
        if reply is None or reply["content"].get("status") != "ok":
            raise KernelError(f"replica {node} did not catch up with the kernel's cells")
        if self._front.is_closing:
            raise KernelError(f"kernel {self._kernel_id} is shutting down")

    async def _abandon(self, node: int, handle: ProcessHandle) -> None:
        # Out of the membership first, while it runs: promoted already, it counts in the
        # majority that must commit its removal; killed first, with the old replica dead
        # too, no majority is left for that removal or for any cell.
        live = list(self._front.alive)
        if not self._closed and live:
            await self._remove_abandoned(node, live)
        self._front.remove_replica(node)
        if handle.returncode is None:
            await handle.terminate(grace=1.0)

    async def _remove_abandoned(self, node: int, live: list[int]) -> None:
        # Shielded by the caller, so bounded here; and cut short if the kernel shuts down.
        with anyio.move_on_after(_ABANDON_TIMEOUT_S) as scope:
            self._scopes.add(scope)
            try:
                await self._change(live, "remove", node)
            except NbosError as exc:
                log.warning(
                    "kernel %s: failed replica %d not removed: %s", self._kernel_id, node, exc
                )
            finally:
                self._scopes.discard(scope)

    async def _change(
        self, live: Sequence[int], op: str, node: int, address: str | None = None
    ) -> dict[str, Any]:
        """Have the Raft leader make one membership change, retried until it took effect
        (or tell its membership: ``members``); the leader's reply."""
        content = _content(op, node, address)
        targets = itertools.cycle(live)
        backoff = _BACKOFF_START_S
        redirects = 0
        while True:
            target = self._leader if self._leader in live else next(targets)
            assert target is not None
            reply = await self._front.control_request(
                target, "nbos_member_request", content, timeout=_REQUEST_TIMEOUT_S
            )
            answer = reply["content"] if reply is not None else {}
            ename = answer.get("ename")
            if answer.get("status") == "ok":
                self._leader = target
                log.info("kernel %s: %s %d done through %d", self._kernel_id, op, node, target)
                return answer
            if ename == "NotLeaderError":
                leader = answer.get("leader")
                self._leader = leader if leader != target else None
                redirects += 1
                # The leader named is asked at once; none named (an election), or
                # followers naming each other round the group, are waited out.
                if self._leader in live and redirects <= len(live):
                    continue
            elif ename in ("ValidationError", "KernelError"):
                raise ReplicationError(f"{op} {node} refused: {answer.get('evalue')}")
            elif ename != "MembershipChangeError":
                # No answer, or a replica shutting down: another one is asked. A leader
                # that refused for now (a learner not caught up, a change pending) is
                # asked again.
                self._leader = None
            log.debug("kernel %s: %s %d not done yet: %s", self._kernel_id, op, node, answer)
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)


def _content(op: str, node: int, address: str | None) -> dict[str, Any]:
    content: dict[str, Any] = {"op": op, "node": node}
    if address is not None:
        content["raft"] = address
    return content
