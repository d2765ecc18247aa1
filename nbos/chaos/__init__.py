"""Chaos testing for replicated kernels: nemeses, a checked workload, a report.

::

    async with nbos.LocalCluster(hosts=4) as cluster:
        kernel = await cluster.start_kernel()
        report = await run_chaos(kernel, seed=7, duration_s=60)
        print(report.table())

:func:`run_chaos` runs a workload of cells with countable effects (``n += 1`` and
``L.append(i)``) while a seeded schedule of :class:`Nemesis` faults strikes; after
each fault it checks exactly-once, that no lost cell ran or left a trace, that
replicas hold equal namespaces and that ``execution_count`` only grows. It drives a
kernel of the embedded cluster, or one of a ``nbos gateway`` by address
(:class:`GatewayKernel`), where the gateway's own nemeses (kill it, kill an agent,
cut a host off; stop it or an agent, load the machine, fill the disk under its state,
flood it with starts, send it malformed requests) can run too, and other kernels of the
cluster are checked to stay alive with their state. The ``nbos chaos`` command does the
same; see ``docs/chaos.md``.
"""

from nbos.chaos._checks import (
    INVARIANTS,
    Violation,
    check_appends,
    check_digests,
    check_effects,
    check_execution_counts,
    check_outcomes,
    check_runs,
)
from nbos.chaos._control_plane import CpuHog, FreezeAgent, FreezeGateway
from nbos.chaos._control_requests import (
    HttpApi,
    MalformedRequests,
    StartFlood,
    malformed_requests,
)
from nbos.chaos._deployment_faults import (
    CommandNetwork,
    GatewayProcesses,
    KillAgent,
    KillGateway,
    Network,
    PartitionHost,
)
from nbos.chaos._freeze import FreezeReplica
from nbos.chaos._full_disk import FillDisk
from nbos.chaos._healthy import Bystander
from nbos.chaos._kills import KillExecutor, KillFollower, KillTwo
from nbos.chaos._nemesis import Nemesis, Strike
from nbos.chaos._processes import LocalGateway, listening_pids, process_state
from nbos.chaos._report import ChaosReport, FaultReport, NemesisSummary
from nbos.chaos._runner import (
    Observer,
    check_supported,
    default_nemeses,
    known_nemeses,
    run_chaos,
)
from nbos.chaos._schedule import PlannedFault, plan_faults
from nbos.chaos._target import (
    EMBEDDED,
    Capability,
    ChaosKernel,
    EmbeddedKernel,
    GatewayKernel,
    KernelView,
)
from nbos.chaos._workload import LOST_ERRORS, CellRecord, Observed, Outcome, Workload

__all__ = [
    "EMBEDDED",
    "INVARIANTS",
    "LOST_ERRORS",
    "Bystander",
    "Capability",
    "CellRecord",
    "ChaosKernel",
    "ChaosReport",
    "CommandNetwork",
    "CpuHog",
    "EmbeddedKernel",
    "FaultReport",
    "FillDisk",
    "FreezeAgent",
    "FreezeGateway",
    "FreezeReplica",
    "GatewayKernel",
    "GatewayProcesses",
    "HttpApi",
    "KernelView",
    "KillAgent",
    "KillExecutor",
    "KillFollower",
    "KillGateway",
    "KillTwo",
    "LocalGateway",
    "MalformedRequests",
    "Nemesis",
    "NemesisSummary",
    "Network",
    "Observed",
    "Observer",
    "Outcome",
    "PartitionHost",
    "PlannedFault",
    "StartFlood",
    "Strike",
    "Violation",
    "Workload",
    "check_appends",
    "check_digests",
    "check_effects",
    "check_execution_counts",
    "check_outcomes",
    "check_runs",
    "check_supported",
    "default_nemeses",
    "known_nemeses",
    "listening_pids",
    "malformed_requests",
    "plan_faults",
    "process_state",
    "run_chaos",
]
