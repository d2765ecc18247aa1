"""Nemeses of the control plane on this machine: stop the gateway or an agent, load the CPUs.

Each acts on real processes: the gateway and its agents (:class:`LocalGateway`) are
stopped with ``SIGSTOP`` and continued with ``SIGCONT``; the CPU hog is ``stress-ng``
(else one Python busy loop per core) in a process group of its own, ended by its PID.
None of them kills a kernel's process: every kernel must come through with its state
(``no-healthy-kernel-dead``), and the gateway must not blame hosts for a silence it
caused (a stopped gateway) or give up a host that is only slow (a stopped agent, a
loaded machine).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import sys

import anyio
import attrs

from nbos.chaos._deployment_faults import _check_hold, _hold, _replica_host
from nbos.chaos._nemesis import Strike, described
from nbos.chaos._processes import LocalGateway, cont, group_members, stop
from nbos.chaos._target import Capability, ChaosKernel
from nbos.core.errors import ConfigError, NemesisUnsupportedError

log = logging.getLogger(__name__)

_LOCAL: frozenset[Capability] = frozenset({"local-gateway"})


@attrs.frozen
class FreezeGateway:
    """``SIGSTOP`` the gateway's process mid-cell, leave it stopped ``hold_s`` seconds
    (drawn from that range), then ``SIGCONT`` it: every host spoke all along, unheard;
    none may be given up, no replica stopped, and the cell in flight ends ok once the
    gateway runs again (its front was stopped with it, not ended)."""

    gateway: LocalGateway | None = None
    hold_s: tuple[float, float] = attrs.field(default=(2.0, 10.0), validator=_check_hold)

    @property
    def name(self) -> str:
        return "freeze-gateway"

    @property
    def needs(self) -> frozenset[Capability]:
        return _LOCAL

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        # Held within the strike: the runner's next step waits for the cell in flight,
        # whose reply comes through the stopped gateway.
        gateway = _given(self.gateway, self, kernel)
        pid = gateway.gateway_pid()
        hold = _hold(rng, self.hold_s)
        try:
            await stop(pid, "the gateway")
            await anyio.sleep(hold)
        finally:
            cont(pid)
        return Strike(f"the gateway (pid {pid}), stopped for {hold} s", ())

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        """Nothing to do: continued by the strike."""


@attrs.frozen
class FreezeAgent:
    """``SIGSTOP`` the agent of a host holding a replica (its replicas run on), leave it
    stopped ``hold_s`` seconds, then ``SIGCONT`` it: a silent agent is suspected, never
    proof that its replicas died; none of them may be stopped for it."""

    gateway: LocalGateway | None = None
    hold_s: tuple[float, float] = attrs.field(default=(2.0, 10.0), validator=_check_hold)

    @property
    def name(self) -> str:
        return "freeze-agent"

    @property
    def needs(self) -> frozenset[Capability]:
        return _LOCAL

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        gateway = _given(self.gateway, self, kernel)
        host, nodes, executor = await _replica_host(kernel, rng)
        pid = await gateway.agent_pid(host)
        hold = _hold(rng, self.hold_s)
        await stop(pid, f"the agent of {host}")
        target = f"agent of {host} (pid {pid}; {described(nodes, executor)}) for {hold} s"
        return Strike(target, (), hold, host=host, pids=(pid,))

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        cont(strike.pids[0])


#: How long a heal waits for a killed CPU hog's processes to end (a loaded machine).
_GROUP_GONE_S = 10.0
_POLL_S = 0.02


def _check_workers(instance: CpuHog, attribute: object, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError("workers", value, "at least 1 (None: one per core)")


@attrs.frozen
class CpuHog:
    """Load every core of this machine for ``hold_s`` seconds: ``stress-ng --cpu N`` when
    it is installed, else N Python busy loops (N: ``workers``, default one per core),
    in a process group of their own that the heal ends (``SIGKILL`` to the group whose
    id is the first process's PID). Heartbeats come late; nothing may be given up."""

    workers: int | None = attrs.field(default=None, validator=_check_workers)
    hold_s: tuple[float, float] = attrs.field(default=(3.0, 10.0), validator=_check_hold)

    @property
    def name(self) -> str:
        return "cpu-hog"

    @property
    def needs(self) -> frozenset[Capability]:
        return _LOCAL

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        workers = self.workers or os.cpu_count() or 1
        hold = _hold(rng, self.hold_s)
        stress = shutil.which("stress-ng")
        # The timeouts are a backstop only: the heal ends the group.
        if stress is not None:
            argvs = [[stress, "--cpu", str(workers), "--timeout", f"{hold + 60:.0f}s"]]
        else:
            busy = f"import time\nend = time.time() + {hold + 60}\nwhile time.time() < end: pass"
            argvs = [[sys.executable, "-c", busy]] * workers
        leader = _spawn(argvs[0], 0)
        pids = (leader, *(_spawn(argv, leader) for argv in argvs[1:]))
        kind = "stress-ng" if stress is not None else "python busy loops"
        target = f"{workers} cores ({kind}, process group {leader}) for {hold} s"
        return Strike(target, (), hold, pids=pids)

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        # The group's id is its first process's PID; stress-ng's workers are in it too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(strike.pids[0], signal.SIGKILL)
        for pid in strike.pids:  # our children: reaped, by PID
            with contextlib.suppress(ChildProcessError):
                await anyio.to_thread.run_sync(os.waitpid, pid, 0)
        # stress-ng's workers are not our children: on a loaded machine one may still run
        # for a moment after the SIGKILL.
        with anyio.move_on_after(_GROUP_GONE_S):
            while group_members(strike.pids[0]):  # noqa: ASYNC110 (not our children: polled)
                await anyio.sleep(_POLL_S)


def _spawn(argv: list[str], group: int) -> int:
    """Start ``argv`` in process group ``group`` (0: a new one it leads), no output; its PID."""
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    return os.posix_spawn(argv[0], argv, os.environ, file_actions=quiet, setpgroup=group)


def _given(
    gateway: LocalGateway | None, nemesis: FreezeGateway | FreezeAgent, kernel: ChaosKernel
) -> LocalGateway:
    if gateway is None:
        raise NemesisUnsupportedError(nemesis.name, sorted(nemesis.needs), kernel.where)
    return gateway
