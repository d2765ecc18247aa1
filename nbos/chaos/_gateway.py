"""Extension points: nemeses that need a gateway daemon, its host agents and real hosts.

The chaos runner drives a kernel of the embedded cluster, whose hosts are virtual: none
can be cut off, and its gateway and agents live in the runner's own process. These
nemeses declare ``needs={"gateway"}``, so :func:`~nbos.chaos.run_chaos` refuses them with
:class:`NemesisUnsupportedError` before anything runs; they get a body once the runner can
drive a kernel of a ``nbos gateway`` by address (the multi-host tests under
``tests/gateway`` partition hosts and kill agents directly meanwhile).
"""

from __future__ import annotations

import random

import attrs

from nbos.chaos._nemesis import Capability, Strike
from nbos.cluster import Kernel
from nbos.core.errors import NemesisUnsupportedError


@attrs.frozen
class _NeedsGateway:
    """A nemesis that only a gateway deployment can carry out; refused elsewhere."""

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def needs(self) -> frozenset[Capability]:
        return frozenset({"gateway"})

    async def strike(self, kernel: Kernel, rng: random.Random) -> Strike:
        raise NemesisUnsupportedError(self.name, ["gateway"], "embedded cluster")

    async def heal(self, kernel: Kernel, strike: Strike) -> None:
        raise NemesisUnsupportedError(self.name, ["gateway"], "embedded cluster")


@attrs.frozen
class PartitionHost(_NeedsGateway):
    """Cut one host holding a replica off the network, then heal the partition."""

    @property
    def name(self) -> str:
        return "partition-host"


@attrs.frozen
class KillGateway(_NeedsGateway):
    """``kill -9`` the gateway mid-cell and start it again from its durable state."""

    @property
    def name(self) -> str:
        return "kill-gateway"


@attrs.frozen
class KillAgent(_NeedsGateway):
    """``kill -9`` the host agent of a host holding a replica, then start it again."""

    @property
    def name(self) -> str:
        return "kill-agent"
