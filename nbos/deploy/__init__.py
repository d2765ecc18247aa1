"""A cluster from a file: ``nbos cluster up|restart|down FILE``.

:func:`load_cluster_file` reads a cluster file strictly (:mod:`nbos.deploy._file`);
:func:`cluster_up` starts its gateway and agents (those that do not run yet),
:func:`cluster_restart` restarts one of them and :func:`cluster_down` shuts its
kernels down and stops them (:mod:`nbos.deploy._up`); :class:`DeployedCluster` kills
and restarts them for
``nbos chaos --cluster FILE``. :func:`swarm_deploy` and :func:`swarm_rm` run nbos as a
Docker Swarm stack instead (:mod:`nbos.deploy._swarm`). See ``docs/deploy.md``.
"""

from nbos.deploy._file import ClusterFile, HostTable, load_cluster_file
from nbos.deploy._swarm import (
    SwarmError,
    SwarmFile,
    gateway_node_ip,
    load_swarm_file,
    render_stack,
    swarm_deploy,
    swarm_rm,
    write_stack,
)
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
    "SwarmError",
    "SwarmFile",
    "cluster_down",
    "cluster_restart",
    "cluster_up",
    "gateway_node_ip",
    "load_cluster_file",
    "load_swarm_file",
    "render_stack",
    "swarm_deploy",
    "swarm_rm",
    "write_stack",
]
