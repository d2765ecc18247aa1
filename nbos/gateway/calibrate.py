"""Measuring the durations the simulator assumes on a running (embedded) gateway.

:func:`calibrate` takes a :class:`~nbos.gateway.service.GatewayService` with an autoscaler
(its host provider starts and stops hosts) and at least ``replicas_per_kernel + 1`` hosts,
and times, ``samples`` times each, what :class:`~nbos.scaling.timings.Timings` holds:

* ``kernel_start``: a kernel's start (its replicas up) and its first cell answered;
* ``gpu_commit``: a cell's GPU pre-commit and commit on a replica's host through the
  scheduler (released at once);
* ``migration_time``: a replica's move to the host without one (a learner that catches up
  and votes, as a waiting cell's migration does);
* ``host_startup``: a host started through the provider until its agent registered and
  reported.

Each figure is the median of its samples; ``progress`` hears of each sample as it is taken.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Awaitable, Callable

import anyio

from nbos.core.errors import ConfigError
from nbos.core.ids import HostId, KernelId
from nbos.gateway._kernel import Kernel
from nbos.gateway.service import GatewayService
from nbos.scaling.timings import Timings

log = logging.getLogger(__name__)

#: ``progress(what, sample, samples, seconds)``: one sample of ``what`` took ``seconds``.
Progress = Callable[[str, int, int, float], None]

#: A sample's exec index far above any cell's, so that the scheduler's ledger keeps them apart.
_CALIBRATION_INDEX = 1_000_000


async def calibrate(
    service: GatewayService, samples: int, progress: Progress | None = None
) -> Timings:
    """The medians of ``samples`` measurements of each duration on ``service``'s cluster.

    Raises :class:`ConfigError` for fewer than one sample or a gateway without an
    autoscaler, and what starting a kernel or host raises when the cluster cannot.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ConfigError("samples", samples, "an integer >= 1")
    if service.autoscaler is None:
        raise ConfigError("gateway.autoscale", False, "true (hosts are started to time them)")
    report = progress or _log_sample

    async def timed(what: str, measure: Callable[[int], Awaitable[float]]) -> float:
        taken = []
        for i in range(samples):
            seconds = await measure(i)
            report(what, i + 1, samples, seconds)
            taken.append(seconds)
        return statistics.median(taken)

    manager = service.kernel_manager
    kernel = await manager.start_kernel(gpus=1)
    try:
        kernel_start = await timed("kernel start", lambda _: _kernel_start(service))
        gpu_commit = await timed("GPU commit", lambda i: _gpu_commit(service, kernel, i))
        migration = await timed("migration", lambda _: _migration(service, kernel))
    finally:
        await kernel.shutdown()
    host_startup = await timed("host start", lambda _: _host_start(service))
    return Timings(
        host_startup=host_startup,
        migration_time=migration,
        gpu_commit=gpu_commit,
        kernel_start=kernel_start,
    )


async def _kernel_start(service: GatewayService) -> float:
    began = time.monotonic()
    kernel = await service.kernel_manager.start_kernel(gpus=0)
    try:
        await kernel.execute("pass")
        return time.monotonic() - began
    finally:
        await kernel.shutdown()


async def _gpu_commit(service: GatewayService, kernel: Kernel, sample: int) -> float:
    scheduler = service.directory.scheduler
    replicas = {r.node: r.host for r in kernel.replicas if r.alive}
    began = time.monotonic()
    grant = await scheduler.acquire(
        KernelId(kernel.kernel_id),
        _CALIBRATION_INDEX + sample,
        replicas,
        last_executor=None,
        gpus=1,
    )
    try:
        await scheduler.committed(grant)
        return time.monotonic() - began
    finally:
        await scheduler.release(grant)


async def _migration(service: GatewayService, kernel: Kernel) -> float:
    held = {r.host for r in kernel.replicas}
    free = [h.host_id for h in service.directory.scheduler.view().hosts if h.host_id not in held]
    if not free:
        raise ConfigError("hosts", len(held), "one more host than a kernel has replicas")
    node = min(r.node for r in kernel.replicas)
    began = time.monotonic()
    await kernel.replace_replica(node, target=HostId(free[0]))
    return time.monotonic() - began


async def _host_start(service: GatewayService) -> float:
    autoscaler = service.autoscaler
    assert autoscaler is not None
    began = time.monotonic()
    host = await autoscaler.start_host()
    seconds = time.monotonic() - began
    with anyio.CancelScope(shield=True):
        await autoscaler.stop_host(host)
    return seconds


def _log_sample(what: str, sample: int, samples: int, seconds: float) -> None:
    log.info("calibrate: %s %d of %d: %.3f s", what, sample, samples, seconds)
