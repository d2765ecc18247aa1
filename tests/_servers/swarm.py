"""A Docker Swarm of several nodes on one machine: one ``dockerd`` per network namespace.

:meth:`Swarm.create` makes the namespaces of :mod:`tests._servers.netns` (one per node,
each with its own address on a private bridge) and starts in each a ``dockerd`` with its
own data root and pid file, as a node of its own (``nsenter --net`` into the namespace,
then ``unshare --mount --uts``; not ``ip netns exec``, whose fresh ``/sys`` hides the
machine's cgroup mounts, without which ``dockerd`` does not start):

* **its own network** (the node's namespace): services with host networking bind the
  node's address, as on a machine of their own;
* **its own host name** (a UTS namespace): Swarm names the node by it, and the stack
  names each agent by ``{{.Node.Hostname}}``;
* **its own paths** (a mount namespace, slave to the machine's):
  a fresh ``tmpfs`` on ``/run`` (so ``/var/run/docker.sock`` and the engine's exec root
  are the node's) and the node's directory bind-mounted on ``/var/lib`` (so
  ``/var/lib/nbos``, where the stack keeps the gateway's and the agents' state, is the
  node's). The stack then uses the same paths a real deployment uses, and the bind
  mounts of its containers resolve on the node that runs them, as on separate machines.
  Templating the stack's paths by node instead would test a stack no real deployment
  runs.

Each engine also listens on ``NODE_DIR/docker.sock``, which the test reaches from
outside the node. The first node runs ``docker swarm init``, the others ``docker swarm
join`` it. :meth:`Swarm.kill_node` SIGKILLs every process of a node (the engine, its
containerd, its containers: a machine that died); :meth:`Swarm.start_node` starts its
engine again on the same data root (the machine rebooted). :meth:`Swarm.stop` SIGKILLs
every process left in the nodes' namespaces (they were all started here), unmounts what
the engines left under the work directory and deletes the namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests._servers._process import ServerUnavailableError
from tests._servers.dockerd import _unmount_under
from tests._servers.netns import Netns

_READY_S = 60.0
# The node's own /run and /var/lib, then its engine (argv after the script: DIR NAME DOCKERD...).
_NODE_SCRIPT = (
    'hostname "$2" && mount -t tmpfs -o mode=0755 nbos-node-run /run '
    '&& mount --bind "$1/var-lib" /var/lib && shift 2 && exec "$@"'
)


class SwarmUnavailableError(ServerUnavailableError):
    """No swarm can run here (not root, no dockerd, no namespaces)."""


@dataclass
class SwarmNode:
    """One node: its namespace, address, directory and engine process."""

    name: str
    address: str
    dir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.dir / "docker.sock"

    @property
    def log(self) -> Path:
        return self.dir / "dockerd.log"

    def docker(self, *args: str, timeout_s: float = 120.0, stdin: bytes | None = None) -> str:
        """``docker ARGS`` against this node's engine; its stdout (raises if it fails)."""
        argv = ["docker", "-H", f"unix://{self.socket}", *args]
        done = subprocess.run(
            argv, input=stdin, capture_output=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.decode().strip()}")
        return done.stdout.decode()

    def answers(self) -> bool:
        try:
            self.docker("version", "--format", "{{.Server.Version}}", timeout_s=10)
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        return True


@dataclass
class Swarm:
    """The swarm of one test; see the module docstring."""

    net: Netns
    workdir: Path
    nodes: dict[str, SwarmNode] = field(default_factory=dict)

    @classmethod
    def create(cls, names: Sequence[str], workdir: Path, clients: Sequence[str] = ()) -> Swarm:
        """Nodes ``names`` in a swarm; ``clients``: namespaces on the same bridge with no
        engine, where a test runs what reaches the nodes' addresses."""
        if os.geteuid() != 0:
            raise SwarmUnavailableError("a swarm of namespaces needs root")
        for binary in ("dockerd", "docker", "unshare", "nsenter"):
            if shutil.which(binary) is None:
                raise SwarmUnavailableError(f"{binary} is not installed (scripts/system-deps.sh)")
        net = Netns.create([*names, *clients])
        swarm = cls(net, workdir)
        try:
            for name in names:
                node_dir = workdir / name
                (node_dir / "var-lib").mkdir(parents=True)
                swarm.nodes[name] = SwarmNode(name, net.address(name), node_dir)
                swarm.start_node(name)
            swarm._form()
        except BaseException:
            swarm.stop()
            raise
        return swarm

    @property
    def manager(self) -> SwarmNode:
        return next(iter(self.nodes.values()))

    def start_node(self, name: str) -> None:
        """Start ``name``'s engine (again) and wait until it answers."""
        node = self.nodes[name]
        dockerd = [
            "dockerd",
            "--host=unix:///var/run/docker.sock",
            f"--host=unix://{node.socket}",
            f"--data-root={node.dir / 'data'}",
            f"--pidfile={node.dir / 'dockerd.pid'}",
            "--iptables=false",
            "--bridge=none",
        ]
        netns = f"--net=/run/netns/{self.net.hosts[name].netns}"
        unshare = ["unshare", "--mount", "--propagation", "slave", "--uts"]
        argv = ["nsenter", netns, *unshare, "sh", "-c", _NODE_SCRIPT, "sh", str(node.dir), name]
        with node.log.open("ab") as log:
            node.process = subprocess.Popen(
                [*argv, *dockerd], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + _READY_S
        while not node.answers():
            if node.process.poll() is not None or time.monotonic() > deadline:
                raise SwarmUnavailableError(
                    f"dockerd of {name} did not come up; its log:\n{node.log.read_text()[-3000:]}"
                )
            time.sleep(0.2)

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of ``name``: its engine, containerd and containers."""
        self._kill_all(self.net.hosts[name].netns)
        process = self.nodes[name].process
        if process is not None:
            process.wait(30)

    def load_image(self, tarball: Path) -> None:
        """``docker load`` the image saved in ``tarball`` on every node."""
        data = tarball.read_bytes()
        for node in self.nodes.values():
            node.docker("load", "--quiet", stdin=data, timeout_s=600)

    def node_ids(self) -> dict[str, str]:
        """Swarm's node id of each node, by host name."""
        lines = self.manager.docker("node", "ls", "--format", "{{json .}}").splitlines()
        return {json.loads(line)["Hostname"]: json.loads(line)["ID"] for line in lines}

    def stop(self) -> None:
        """SIGKILL everything in the nodes' namespaces, unmount, delete the namespaces."""
        for name in self.nodes:
            self._kill_all(self.net.hosts[name].netns)
        for node in self.nodes.values():
            if node.process is not None:
                node.process.wait(30)
        self.net.stop()
        _unmount_under(self.workdir)

    def _form(self) -> None:
        manager = self.manager
        manager.docker(
            "swarm", "init", "--advertise-addr", manager.address,
            "--listen-addr", f"{manager.address}:2377",
        )  # fmt: skip
        token = manager.docker("swarm", "join-token", "--quiet", "worker").strip()
        for node in list(self.nodes.values())[1:]:
            node.docker(
                "swarm", "join", "--token", token, "--advertise-addr", node.address,
                "--listen-addr", f"{node.address}:2377", f"{manager.address}:2377",
            )  # fmt: skip

    def _kill_all(self, netns: str) -> None:
        # Every process in a node's namespace was started by this harness (its engine and
        # what the engine started), so each is ended by its PID, none by name.
        for _ in range(50):
            done = subprocess.run(
                ["ip", "netns", "pids", netns], capture_output=True, text=True, check=False
            )
            pids = [int(pid) for pid in done.stdout.split()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
