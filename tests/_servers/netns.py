"""Many hosts on one machine: network namespaces with their own addresses on a private bridge.

:meth:`Netns.create` makes, all under one random tag:

* a *hub* namespace holding a bridge (``br0``),
* one namespace per host, joined to the bridge by a veth pair created directly
  between the two namespaces, with address ``10.233.0.N/24`` on its ``eth0`` and
  its own loopback up.

Nothing is added to the namespace the tests run in: the subnet exists only inside
the namespaces made here, so it cannot clash with or leak to the machine's own
networks. :meth:`Netns.popen` runs commands inside a host (``ip netns exec``),
:meth:`Netns.partition` cuts a host off with iptables in its own namespace (its
loopback keeps working) and :meth:`Netns.heal` undoes it; :meth:`Netns.stop`
ends the processes started here, by PID, and deletes exactly the namespaces made
here. Needs root and a working ``ip netns``; otherwise :meth:`create` raises
:class:`NetnsUnavailableError`, which :func:`serve_or_skip` turns into a skip.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests._servers._process import ServerUnavailableError, serve_or_skip, stop_process

SUBNET = "10.233.0"
_PREFIX = 24
_STOP_TIMEOUT_S = 10.0
# iptables rules that cut a host off, all but loopback; the same spec deletes them.
_CUT = (("INPUT", "-i"), ("OUTPUT", "-o"))


class NetnsUnavailableError(ServerUnavailableError):
    """Namespaces cannot be made here (not root, no ``ip``, no netns support)."""


@dataclass
class NetHost:
    """One host: its namespace and its address on the bridge."""

    name: str
    netns: str
    address: str


@dataclass
class Netns:
    """The namespaces of one test; see the module docstring."""

    tag: str
    hosts: dict[str, NetHost] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log: Path | None = None

    @classmethod
    def create(cls, names: Sequence[str]) -> Netns:
        if os.geteuid() != 0:
            raise NetnsUnavailableError("network namespaces need root")
        if shutil.which("ip") is None or shutil.which("iptables") is None:
            raise NetnsUnavailableError("needs the ip and iptables commands")
        if not 0 < len(names) < 250 or len(set(names)) != len(names):
            raise ValueError(f"1 to 249 distinct host names, got {names!r}")
        net = cls(tag=f"nbos-{os.getpid()}-{secrets.token_hex(3)}")
        try:
            net._build(names)
        except BaseException:
            net.stop()
            raise
        return net

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def address(self, host: str) -> str:
        return self.hosts[host].address

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``host``; :meth:`stop` ends it if the test did not."""
        process = subprocess.Popen(self.argv(host, argv), **kwargs)
        self.processes.append(process)
        return process

    def run(self, host: str, argv: Sequence[str]) -> str:
        """Run ``argv`` in ``host`` to completion; its output (raises if it fails)."""
        return _ip_run(self.argv(host, argv))

    def partition(self, host: str) -> None:
        """Drop every packet into and out of ``host`` except on its loopback."""
        for argv in self.cut_commands(host):
            _ip_run(argv)

    def heal(self, host: str) -> None:
        """Undo :meth:`partition`."""
        for argv in self.cut_commands(host, heal=True):
            _ip_run(argv)

    def cut_commands(self, host: str, *, heal: bool = False) -> list[list[str]]:
        """The commands of :meth:`partition` (``heal``: of :meth:`heal`), to run elsewhere."""
        action = "-D" if heal else "-I"
        return [
            self.argv(host, ["iptables", action, chain, "!", flag, "lo", "-j", "DROP"])
            for chain, flag in _CUT
        ]

    def stop(self) -> None:
        """End the processes started here, then delete the namespaces made here."""
        for process in self.processes:
            stop_process(process, _STOP_TIMEOUT_S)
        for netns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", netns], check=False, capture_output=True)
        self.made.clear()

    def _build(self, names: Sequence[str]) -> None:
        self._add_netns(self.hub)
        hub = ["ip", "-n", self.hub]
        _ip_run([*hub, "link", "add", "br0", "type", "bridge"])
        _ip_run([*hub, "link", "set", "br0", "up"])
        for i, name in enumerate(names):
            netns = f"{self.tag}-{i}"
            self._add_netns(netns)
            port = f"h{i}"
            veth = ["type", "veth", "peer", "name", "eth0", "netns", netns]
            _ip_run([*hub, "link", "add", port, *veth])
            _ip_run([*hub, "link", "set", port, "master", "br0", "up"])
            address = f"{SUBNET}.{i + 1}"
            inside = ["ip", "-n", netns]
            _ip_run([*inside, "addr", "add", f"{address}/{_PREFIX}", "dev", "eth0"])
            _ip_run([*inside, "link", "set", "eth0", "up"])
            _ip_run([*inside, "link", "set", "lo", "up"])
            self.hosts[name] = NetHost(name, netns, address)

    def _add_netns(self, netns: str) -> None:
        try:
            _ip_run(["ip", "netns", "add", netns])
        except RuntimeError as exc:
            raise NetnsUnavailableError(str(exc)) from exc
        self.made.append(netns)


def _ip_run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def netns_or_skip(names: Sequence[str]) -> Iterator[Netns]:
    """The body of a fixture: hosts ``names`` in namespaces, or a skip saying why not."""
    return serve_or_skip(lambda: Netns.create(names), "network namespaces (root, ip netns)")
