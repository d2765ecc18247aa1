"""The host agent: one per host, serving the gateway's GPU requests over a ``Transport``.

The agent wraps its host's :class:`~nbos.gpu.GpuPool` (pure bookkeeping) with
everything that needs time and I/O: answering requests, expiring pre-commits
that no cell claims, reporting its state, and lazy eviction, where a device
handed to a new holder still holds another kernel's tensors and that kernel's
replica on this host must move them off first (the ``on_evict`` hook).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc

from nbos.core.errors import (
    ConfigError,
    GpuError,
    InsufficientGpusError,
    TransportError,
    UnknownReservationError,
)
from nbos.core.ids import KernelId, PeerId
from nbos.core.transport import Transport
from nbos.core.wire import AnyMessage, encode
from nbos.core.wire.agent import (
    AgentReply,
    AgentRestore,
    AgentStatus,
    AgentStatusRequest,
    GpuCommit,
    GpuEvicted,
    GpuFreed,
    GpuGranted,
    GpuPrecommit,
    GpuRefused,
    GpuRelease,
    GpuReleaseKernel,
    GpuReservation,
    RefusalReason,
)
from nbos.gpu import Allocation, GpuPool
from nbos.transport import received_messages

log = logging.getLogger(__name__)

#: ``on_evict(kernel, devices)``: the kernel's replica on this host must move all of
#: its resident tensors to host memory (``devices`` are the ones about to be reused).
EvictHook = Callable[[KernelId, tuple[int, ...]], Awaitable[None]]

#: How long a replica may take to move its resident tensors off a device.
EVICT_TIMEOUT_S = 30.0

#: How many reservations the agent remembers as already evicted for, so retries skip it.
_EVICTED_MEMORY = 4096


def available_memory_mib(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The memory this machine has available for new processes, in MiB (``MemAvailable``);
    ``None`` where there is no such file or line (not Linux)."""
    try:
        with meminfo.open() as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == "MemAvailable":
                    return int(rest.split()[0]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reservation_message(alloc: Allocation) -> GpuReservation:
    """The wire form of a pool allocation."""
    return GpuReservation(
        reservation_id=alloc.reservation_id,
        kernel_id=alloc.kernel_id,
        devices=list(alloc.devices),
        state=alloc.state,
        evict_from=sorted(alloc.evict_from.items()),
    )


class HostAgent:
    """Serves one host's GPU pool to the gateway; build it with :meth:`serve`.

    Contracts:

    * every request gets exactly one reply with its ``request_id``; requests are
      idempotent (the pool is), so the gateway may retry freely;
    * undecodable messages, messages from peers other than the gateway and
      requests the pool refuses are logged and answered (or dropped), never fatal;
    * a pre-commit or commit whose devices hold another kernel's tensors is
      answered only after ``on_evict`` returned for that kernel (within
      ``evict_timeout``); if it fails, the reservation is released and refused
      with reason ``"evict_failed"``;
    * :class:`~nbos.core.wire.agent.AgentStatus` goes to the gateway at start, every
      ``heartbeat_interval`` and whenever pre-commits expire.
    """

    def __init__(
        self,
        host_id: str,
        transport: Transport,
        pool: GpuPool,
        *,
        gateway: PeerId,
        address: str,
        clock: Callable[[], float],
        on_evict: EvictHook | None,
        evict_timeout: float,
    ) -> None:
        self._host_id = host_id
        self._transport = transport
        self._pool = pool
        self._gateway = gateway
        self._address = address
        self._clock = clock
        self._on_evict = on_evict
        self._evict_timeout = evict_timeout
        self._incarnation = uuid.uuid4().hex
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._evicting: dict[str, anyio.Event] = {}

    @classmethod
    @asynccontextmanager
    async def serve(
        cls,
        host_id: str,
        transport: Transport,
        pool: GpuPool,
        *,
        gateway: PeerId | str,
        gateway_address: str,
        address: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_evict: EvictHook | None = None,
        evict_timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        expire_interval: float | None = None,
    ) -> AsyncIterator[HostAgent]:
        """Run the agent until the block exits.

        ``address`` is where the gateway reaches this agent (default: the
        transport's ``address`` attribute, which both nbos transports have);
        ``clock`` must be the one ``pool`` was built with (the agent rebuilds the
        pool with it on :class:`~nbos.core.wire.agent.AgentRestore`).
        ``expire_interval`` defaults to a quarter of the pool's pre-commit TTL.
        """
        own = address if address is not None else getattr(transport, "address", None)
        if not isinstance(own, str) or not own:
            raise ConfigError("address", own, "the address the gateway reaches this agent at")
        for key, value in (
            ("evict_timeout", evict_timeout),
            ("heartbeat_interval", heartbeat_interval),
        ):
            if not value > 0:
                raise ConfigError(key, value, "a positive number of seconds")
        expire_every = pool.precommit_ttl / 4 if expire_interval is None else expire_interval
        transport.add_peer(PeerId(gateway), gateway_address)
        agent = cls(
            host_id,
            transport,
            pool,
            gateway=PeerId(gateway),
            address=own,
            clock=clock,
            on_evict=on_evict,
            evict_timeout=evict_timeout,
        )
        log.info("agent of host %s serving %d GPUs", host_id, len(pool.devices))
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent._receive_loop, tg)
            tg.start_soon(agent._every, heartbeat_interval, agent.report)
            tg.start_soon(agent._every, expire_every, agent._expire)
            try:
                yield agent
            finally:
                tg.cancel_scope.cancel()

    # --- queries -------------------------------------------------------------------

    @property
    def host_id(self) -> str:
        return self._host_id

    @property
    def incarnation(self) -> str:
        """Random per agent start: a new value tells the gateway the agent restarted."""
        return self._incarnation

    @property
    def pool(self) -> GpuPool:
        """The pool now (replaced by a new one on ``AgentRestore``)."""
        return self._pool

    def status(self, request_id: int | None = None) -> AgentStatus:
        """The agent's whole pool as a report."""
        return AgentStatus(
            host_id=self._host_id,
            incarnation=self._incarnation,
            address=self._address,
            devices=list(self._pool.devices),
            reservations=[reservation_message(a) for a in self._pool.reservations()],
            resident=sorted(self._pool.resident().items()),
            request_id=request_id,
            memory_available_mib=available_memory_mib(),
        )

    # --- actions -------------------------------------------------------------------

    async def report(self) -> None:
        """Send the status to the gateway now."""
        await self._send(self.status())

    def evicted(self, kernel_id: KernelId) -> None:
        """The kernel's replica here moved its resident tensors off by itself."""
        self._pool.evicted(kernel_id)

    # --- loops ---------------------------------------------------------------------

    async def _every(self, interval: float, action: Callable[[], Awaitable[None]]) -> None:
        while True:
            await action()
            await anyio.sleep(interval)

    async def _expire(self) -> None:
        if self._pool.expire():
            await self.report()

    async def _receive_loop(self, tg: anyio.abc.TaskGroup) -> None:
        async for sender, message in received_messages(
            self._transport, f"agent of host {self._host_id}"
        ):
            if sender != self._gateway:
                log.warning(
                    "agent %s dropped %s from %s", self._host_id, type(message).__name__, sender
                )
                continue
            if isinstance(message, GpuPrecommit | GpuCommit):
                # These may wait for an eviction; nothing else should wait behind them.
                tg.start_soon(self._reserve, message)
            else:
                await self._send(self._answer(message))

    # --- requests ------------------------------------------------------------------

    def _answer(self, message: AnyMessage) -> AgentReply | None:
        match message:
            case GpuRelease(request_id=rid, reservation_id=res, resident=resident):
                return GpuFreed(rid, [res], list(self._pool.release(res, resident=resident)))
            case GpuReleaseKernel(request_id=rid, kernel_id=kernel):
                freed = self._pool.release_kernel(KernelId(kernel))
                freed_devices = sorted(d for a in freed for d in a.devices)
                return GpuFreed(rid, [a.reservation_id for a in freed], freed_devices)
            case GpuEvicted(request_id=rid, kernel_id=kernel):
                self._pool.evicted(KernelId(kernel))
                return GpuFreed(rid)
            case AgentStatusRequest(request_id=rid):
                return self.status(rid)
            case AgentRestore():
                return self._restore(message)
        log.warning("agent %s dropped unexpected %s", self._host_id, type(message).__name__)
        return None

    async def _reserve(self, message: GpuPrecommit | GpuCommit) -> None:
        rid, res = message.request_id, message.reservation_id
        kernel = KernelId(message.kernel_id)
        first = frozenset(KernelId(k) for k in message.evict_first)
        try:
            if isinstance(message, GpuPrecommit):
                alloc = self._pool.precommit(res, kernel, message.n, evict_first=first)
            else:
                alloc = self._pool.commit(res, kernel, message.n, evict_first=first)
        except InsufficientGpusError as exc:
            await self._send(self._refused(rid, "insufficient", exc))
            return
        except UnknownReservationError as exc:
            await self._send(
                self._refused(rid, "expired" if exc.why == "expired" else "unknown", exc)
            )
            return
        except GpuError as exc:
            await self._send(self._refused(rid, "invalid", exc))
            return
        if alloc.evict_from and not await self._evict_for(alloc):
            self._pool.release(res)
            error = GpuError(f"eviction for reservation {res} failed")
            await self._send(self._refused(rid, "evict_failed", error))
            return
        current = self._pool.lookup(res) or alloc
        await self._send(GpuGranted(rid, reservation_message(current)))

    async def _evict_for(self, alloc: Allocation) -> bool:
        """Have every kernel resident on ``alloc``'s devices evict; ``False`` if one failed."""
        res = alloc.reservation_id
        if res in self._evicted:
            return True
        running = self._evicting.get(res)
        if running is not None:
            # A retried request while the first one evicts: share its outcome.
            await running.wait()
            return res in self._evicted
        done = self._evicting[res] = anyio.Event()
        try:
            ok = await self._run_evictions(res, alloc.evict_from)
        finally:
            del self._evicting[res]
            done.set()
        if ok:
            self._evicted[res] = None
            while len(self._evicted) > _EVICTED_MEMORY:
                self._evicted.popitem(last=False)
        return ok

    async def _run_evictions(self, res: str, evict_from: Mapping[int, KernelId]) -> bool:
        by_kernel: dict[KernelId, list[int]] = {}
        for device, kernel in sorted(evict_from.items()):
            by_kernel.setdefault(kernel, []).append(device)
        for kernel, devices in by_kernel.items():
            if self._on_evict is None:
                log.debug("no eviction hook: kernel %s keeps devices %s", kernel, devices)
                continue
            try:
                with anyio.fail_after(self._evict_timeout):
                    await self._on_evict(kernel, tuple(devices))
            except Exception as exc:
                log.warning(
                    "host %s: eviction of kernel %s from devices %s for %s failed: %r",
                    self._host_id,
                    kernel,
                    devices,
                    res,
                    exc,
                )
                return False
            self._pool.evicted(kernel)
            log.info("host %s: kernel %s evicted from devices %s", self._host_id, kernel, devices)
        return True

    def _restore(self, message: AgentRestore) -> AgentReply:
        """Take back committed reservations lost in a restart, keeping what the pool holds now."""
        old = self._pool
        committed = {a.reservation_id: a for a in old.committed()}
        for r in message.reservations:
            if r.state == "committed" and r.reservation_id not in committed:
                committed[r.reservation_id] = Allocation(
                    r.reservation_id,
                    KernelId(r.kernel_id),
                    tuple(r.devices),
                    "committed",
                    self._clock(),
                )
        try:
            pool = GpuPool.restore(
                old.devices, self._clock, old.precommit_ttl, committed.values(), old.resident()
            )
        except GpuError as exc:
            return self._refused(message.request_id, "invalid", exc)
        for alloc in old.reservations():
            if alloc.state == "precommitted":
                self._keep_precommit(pool, alloc)
        self._pool = pool
        restored = sorted(set(committed) - {a.reservation_id for a in old.committed()})
        log.info("host %s restored %d committed reservations", self._host_id, len(restored))
        return GpuFreed(message.request_id, restored)

    def _keep_precommit(self, pool: GpuPool, alloc: Allocation) -> None:
        try:
            pool.precommit(alloc.reservation_id, alloc.kernel_id, len(alloc.devices))
        except GpuError as exc:
            # Its cell's commit will take fresh devices (or be refused) instead.
            log.info(
                "host %s dropped pre-commit %s on restore: %s",
                self._host_id,
                alloc.reservation_id,
                exc,
            )

    def _refused(self, request_id: int, reason: RefusalReason, exc: Exception) -> GpuRefused:
        log.info("host %s refused request %d (%s): %s", self._host_id, request_id, reason, exc)
        return GpuRefused(request_id, reason, str(exc), idle=len(self._pool.idle_devices()))

    async def _send(self, message: AgentReply | None) -> None:
        if message is None:
            return
        try:
            await self._transport.send(self._gateway, encode(message))
        except TransportError as exc:
            # The gateway retries requests and statuses repeat: a lost reply costs a retry.
            log.warning("agent %s could not reach the gateway: %s", self._host_id, exc)
