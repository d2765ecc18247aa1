"""Extension points: nemeses that need a gateway, its host agents and real hosts.

nbos has no gateway process yet: the embedded cluster runs every replica on this
machine under one Python process. These nemeses declare ``needs={"gateway"}``, so
:func:`~nbos.chaos.run_chaos` refuses them with :class:`NemesisUnsupportedError`
before anything runs; they get a body once there is a gateway to run them against.
"""

from __future__ import annotations

import random

import attrs

from nbos.chaos._nemesis import Capability, Strike
from nbos.cluster import Kernel
from nbos.core.errors import NemesisUnsupportedError

_GATEWAY: frozenset[Capability] = frozenset({"gateway"})


def _refuse(name: str) -> NemesisUnsupportedError:
    return NemesisUnsupportedError(name, ["gateway"], "embedded cluster")


@attrs.frozen
class PartitionHost:
    """Cut one host holding a replica off the network, then heal the partition."""

    @property
    def name(self) -> str:
        return "partition-host"

    @property
    def needs(self) -> frozenset[Capability]:
        return _GATEWAY

    async def strike(self, kernel: Kernel, rng: random.Random) -> Strike:
        raise _refuse(self.name)

    async def heal(self, kernel: Kernel, strike: Strike) -> None:
        raise _refuse(self.name)


@attrs.frozen
class KillGateway:
    """``kill -9`` the gateway mid-cell and start it again from its durable state."""

    @property
    def name(self) -> str:
        return "kill-gateway"

    @property
    def needs(self) -> frozenset[Capability]:
        return _GATEWAY

    async def strike(self, kernel: Kernel, rng: random.Random) -> Strike:
        raise _refuse(self.name)

    async def heal(self, kernel: Kernel, strike: Strike) -> None:
        raise _refuse(self.name)


@attrs.frozen
class KillAgent:
    """``kill -9`` the host agent of a host holding a replica, then start it again."""

    @property
    def name(self) -> str:
        return "kill-agent"

    @property
    def needs(self) -> frozenset[Capability]:
        return _GATEWAY

    async def strike(self, kernel: Kernel, rng: random.Random) -> Strike:
        raise _refuse(self.name)

    async def heal(self, kernel: Kernel, strike: Strike) -> None:
        raise _refuse(self.name)
