"""The scheduler's conversation with the host agents, beyond choosing a cell's executor.

Requests go out with retries (an agent that does not answer is suspected);
reports come in: a host joins (what it holds from an earlier gateway is freed), its
agent restarts (it is given back the committed reservations it lost), it comes back
(releases it missed are resent). Releases meant for a suspected agent are kept,
and so are the kernels whose release a host has not confirmed, until it reports again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from nbos.core.errors import ConfigError, HostUnreachableError, TransportError
from nbos.core.ids import HostId, KernelId, PeerId
from nbos.core.transport import Transport
from nbos.core.wire.agent import (
    AgentReply,
    AgentRequest,
    AgentRestore,
    AgentStatus,
    AgentStatusRequest,
    GpuFreed,
    GpuGranted,
    GpuRefused,
    GpuRelease,
    GpuReleaseKernel,
    GpuReservation,
)
from nbos.gateway._host_liveness import HostLiveness
from nbos.gateway._hosts import HostRecord, Hosts
from nbos.gateway._rpc import RequestChannel
from nbos.metrics import ClusterEvent, events
from nbos.transport import received_messages

log = logging.getLogger(__name__)


class AgentSync:
    """Requests to the agents and their reports, reconciled with the scheduler's grants."""

    def __init__(
        self,
        transport: Transport,
        rpc: RequestChannel[AgentRequest, AgentReply],
        hosts: Hosts,
        liveness: HostLiveness,
        *,
        notify: Callable[[], None],
        spawn: Callable[..., None],
        registered: bool,
    ) -> None:
        self._transport = transport
        self._rpc = rpc
        self._hosts = hosts
        self._liveness = liveness
        self._notify = notify
        self._spawn = spawn
        self._pending_release: dict[str, tuple[HostId, bool]] = {}
        # (host, kernel) whose ReleaseKernel the host has not confirmed yet.
        self._owed: set[tuple[HostId, KernelId]] = set()
        # Peers admitted by registration (HostDirectory), or None: hosts are learnt
        # from their reports, the scheduler connecting to the address they give.
        self._admitted: dict[HostId, PeerId] | None = {} if registered else None

    # --- hosts ---------------------------------------------------------------------

    def admit(self, host_id: HostId, peer: PeerId) -> None:
        """Registration took ``host_id``'s agent at ``peer``: its reports count from now on."""
        if self._admitted is None:
            raise ConfigError("registered", False, "a scheduler serving registered hosts")
        self._admitted[host_id] = peer

    def suspected(self, host_id: HostId, why: str) -> None:
        """The host directory suspects the host: its reports count again once it registers."""
        if self._admitted is not None:
            self._admitted.pop(host_id, None)
        host = self._hosts.get(host_id)
        if host is not None:
            self._liveness.suspect(host, why)

    def removed(self, host_id: HostId) -> None:
        """The host left the cluster: its reports no longer count, nothing is owed to it."""
        if self._admitted is not None:
            self._admitted.pop(host_id, None)
        self._liveness.forget(host_id)
        self._owed = {(h, k) for h, k in self._owed if h != host_id}

    def kernel_lives_on(self, kernel_id: KernelId, hosts: Iterable[HostId]) -> None:
        """The kernel has live replicas on ``hosts``: nothing is owed for it there."""
        self._owed -= {(h, kernel_id) for h in hosts}

    # --- requests ------------------------------------------------------------------

    async def call(self, host: HostRecord, make: Callable[[int], AgentRequest]) -> AgentReply:
        """One request to the host's agent, resent until it answers; an agent that does not
        is suspected (:class:`HostUnreachableError`)."""
        try:
            return await self._rpc.call(host.peer, host.host_id, make)
        except HostUnreachableError as exc:
            if not self._rpc.closed:  # else the scheduler stops: the host is not to blame
                self._liveness.suspect(host, str(exc))
            raise

    async def release(self, host_id: HostId, res: str, resident: bool) -> None:
        """Free reservation ``res`` on the host, now or (suspected) when it reports again."""
        host = self._hosts.get(host_id)
        if host is None or host.suspected:
            self._pending_release[res] = (host_id, resident)
            self._notify()
            return
        await self._send_release(host, res, resident)

    async def release_kernel(self, host_id: HostId, kernel_id: KernelId) -> None:
        """Free everything of the kernel on the host, resident marks included; a suspected
        host is told when it reports again."""
        self._owed.add((host_id, kernel_id))
        host = self._hosts.get(host_id)
        if host is not None and not host.suspected:
            await self._send_release_kernel(host, kernel_id)

    def refresh_soon(self, host: HostRecord) -> None:
        """Ask the host's agent for a fresh report (the scheduler's view of it was stale)."""
        self._spawn(self._refresh, host)

    def release_soon(self, host: HostRecord, res: str) -> None:
        self._spawn(self._send_release, host, res, False)

    async def _send_release(self, host: HostRecord, res: str, resident: bool) -> None:
        try:
            await self.call(host, lambda rid: GpuRelease(rid, res, resident))
        except HostUnreachableError:
            self._pending_release[res] = (host.host_id, resident)
        else:
            self._pending_release.pop(res, None)
            host.reported.pop(res, None)
            self._hosts.synced(host.host_id)
        self._notify()

    async def _send_release_kernel(self, host: HostRecord, kernel_id: KernelId) -> None:
        try:
            await self.call(host, lambda rid: GpuReleaseKernel(rid, kernel_id))
        except HostUnreachableError:
            return
        self._owed.discard((host.host_id, kernel_id))
        for res in [r for r, g in host.reported.items() if g.kernel_id == kernel_id]:
            del host.reported[res]
        self._hosts.synced(host.host_id)
        self._notify()

    async def _refresh(self, host: HostRecord) -> None:
        try:
            reply = await self.call(host, AgentStatusRequest)
        except HostUnreachableError:
            return
        if isinstance(reply, AgentStatus):
            self._on_status(host.peer, reply)

    async def _restore(self, host: HostRecord, lost: list[GpuReservation]) -> None:
        log.warning(
            "agent of host %s restarted without %d committed reservations; restoring",
            host.host_id,
            len(lost),
        )
        try:
            reply = await self.call(host, lambda rid: AgentRestore(rid, lost))
        except HostUnreachableError:
            return
        if isinstance(reply, GpuRefused):
            log.warning("host %s refused to restore reservations: %s", host.host_id, reply.message)
        await self._refresh(host)

    # --- reports -------------------------------------------------------------------

    async def receive(self) -> None:
        """Take the agents' reports and replies until cancelled."""
        try:
            async for sender, message in received_messages(self._transport, "scheduler"):
                self._received(sender, message)
        finally:
            # No reply can reach a call from now on: calls must not wait out their timeout
            # (a cluster torn down by cancellation would hang in its shielded releases).
            self._rpc.close()

    def _received(self, sender: PeerId, message: object) -> None:
        if isinstance(message, AgentStatus) and message.request_id is None:
            self._on_status(sender, message)
        elif isinstance(message, AgentStatus | GpuGranted | GpuRefused | GpuFreed):
            if message.request_id is None or not self._rpc.deliver(message.request_id, message):
                log.debug("late or duplicate %s from %s dropped", type(message).__name__, sender)
        else:
            log.warning("scheduler dropped unexpected %s from %s", type(message).__name__, sender)

    def _on_status(self, sender: PeerId, status: AgentStatus) -> None:
        host_id = HostId(status.host_id)
        host = self._hosts.get(host_id)
        if not self._counts(host, sender, status):
            return
        if host is None:
            host = HostRecord(
                host_id, sender, status.address, status.incarnation, tuple(status.devices)
            )
            host.update(sender, status)
            self._hosts.join(host)
            self._liveness.reported(host)
            log.info("host %s joined with %d GPUs", host_id, len(host.devices))
            events().happened(
                ClusterEvent(
                    "host-joined",
                    f"host {host_id} joined with {len(host.devices)} GPUs",
                    host=host_id,
                )
            )
            self._release_foreign(host)
        else:
            if host.update(sender, status):
                self._reconcile(host)
            self._liveness.reported(host)
            self._hosts.synced(host_id)
        self._resend(host)
        self._notify()

    def _counts(self, host: HostRecord | None, sender: PeerId, status: AgentStatus) -> bool:
        """Whether the report is to be taken (connecting to a host learnt from it)."""
        if self._admitted is not None:
            # Registration connected to the host (with its key); reports count only
            # from the peer it admitted, and the address it checked stays.
            if self._admitted.get(HostId(status.host_id)) == sender:
                return True
            log.debug("status of %s from %s, not an admitted host: dropped", status.host_id, sender)
            return False
        if host is not None and (host.peer, host.address) == (sender, status.address):
            return True
        try:
            self._transport.add_peer(sender, status.address)
        except TransportError as exc:
            log.warning(
                "host %s reported a bad address %r: %s", status.host_id, status.address, exc
            )
            return False
        return True

    def _release_foreign(self, host: HostRecord) -> None:
        """Free what the first report of ``host`` holds: this scheduler granted nothing there
        yet, so those are the grants of an earlier gateway, which died with it.

        The tensors stay resident (the replicas live on), to be evicted lazily. A cell
        that was running when that gateway died may still use its devices a while.
        """
        for res, reservation in list(host.reported.items()):
            log.info(
                "host %s: reservation %s of kernel %s is not ours (an earlier gateway's): released",
                host.host_id,
                res,
                reservation.kernel_id,
            )
            self._spawn(self._send_release, host, res, True)

    def _reconcile(self, host: HostRecord) -> None:
        """A new agent incarnation: give it back the committed reservations it lost."""
        lost = [
            GpuReservation(res, g.kernel_id, list(g.devices), "committed")
            for res, g in self._hosts.on(host.host_id).items()
            if res in self._hosts.committed and res not in host.reported
        ]
        log.info(
            "agent of host %s (re)started; %d committed reservations to restore",
            host.host_id,
            len(lost),
        )
        if lost:
            self._spawn(self._restore, host, lost)

    def _resend(self, host: HostRecord) -> None:
        """Retry releases that a suspected agent missed, now that it reported them."""
        for res, (host_id, _) in list(self._pending_release.items()):
            if host_id == host.host_id and res not in host.reported:
                del self._pending_release[res]  # expired or lost there: nothing left to free
        for res in host.reported:
            pending = self._pending_release.get(res)
            if pending is not None:
                self._spawn(self._send_release, host, res, pending[1])
        for host_id, kernel in list(self._owed):
            if host_id == host.host_id:
                self._spawn(self._send_release_kernel, host, kernel)
