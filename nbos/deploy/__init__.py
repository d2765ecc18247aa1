"""A cluster from a file: ``nbos cluster up|restart|down FILE``.

:func:`load_cluster_file` reads a cluster file strictly (:mod:`nbos.deploy._file`);
:func:`cluster_up` starts its gateway and agents (those that do not run yet),
:func:`cluster_restart` restarts one of them and :func:`cluster_down` shuts its
kernels down and stops them (:mod:`nbos.deploy._up`); :class:`DeployedCluster` kills
and restarts them for
``nbos chaos --cluster FILE``. See ``docs/deploy.md``.
"""

from nbos.deploy._file import ClusterFile, HostTable, load_cluster_file
from nbos.deploy._up import (
    DeployedCluster,
    Deployment,
    cluster_down,
    cluster_restart,
    cluster_up,
)

__all__ = [
    "ClusterFile",
    "DeployedCluster",
    "Deployment",
    "HostTable",
    "cluster_down",
    "cluster_restart",
    "cluster_up",
    "load_cluster_file",
]
