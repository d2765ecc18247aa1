"""The gateway: the cluster's global GPU scheduler, and how a cell's GPU count is found.

* :class:`GpuScheduler` places kernels' replicas and grants GPUs to cells through
  the host agents (:mod:`nbos.agent`); see ``docs/placement.md``.
* :mod:`nbos.gateway.requests` works out how many GPUs a cell asks for.
"""

from nbos.gateway._hosts import Grant, HostRecord
from nbos.gateway._scheduler import CellLease, GpuScheduler, WaitCallback

__all__ = ["CellLease", "GpuScheduler", "Grant", "HostRecord", "WaitCallback"]
