"""A Docker Swarm's nodes, through a manager's engine API (the ``docker`` extra, aiodocker).

What nbos needs of them: which nodes carry a label (the nodes an agent service runs
on), each node's hostname (the agent's host id there) and availability, and setting
a node's availability (``active``: Swarm runs the global agent service's task there;
``drain``: Swarm stops it). Only a manager's engine answers these requests.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import aiodocker
import aiohttp
import attrs

from nbos.core.errors import BackendError, ConfigError

log = logging.getLogger(__name__)

Availability = Literal["active", "pause", "drain"]
_SCHEMES = ("unix", "tcp", "http", "https")


@attrs.frozen
class SwarmNode:
    """One node as the manager reports it."""

    node_id: str
    hostname: str
    availability: str
    state: str
    labels: Mapping[str, str]
    version: int
    spec: Mapping[str, Any]

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> SwarmNode:
        spec = raw.get("Spec", {})
        return cls(
            str(raw["ID"]),
            str(raw.get("Description", {}).get("Hostname", "")),
            str(spec.get("Availability", "")),
            str(raw.get("Status", {}).get("State", "")),
            dict(spec.get("Labels") or {}),
            int(raw.get("Version", {}).get("Index", 0)),
            spec,
        )


class SwarmNodes:
    """A swarm manager's node API at ``engine`` (``unix://`` or ``tcp://``)."""

    def __init__(self, engine: str) -> None:
        if engine.partition("://")[0] not in _SCHEMES:
            raise ConfigError("engine", engine, "a swarm manager's engine URL (unix:// or tcp://)")
        self.engine = engine
        self._client: aiodocker.Docker | None = None

    async def labelled(self, label: str) -> list[SwarmNode]:
        """The nodes that carry ``label`` (any value), by hostname."""
        return await self._list({"node.label": label})

    async def named(self, hostname: str) -> SwarmNode | None:
        """The node whose hostname is ``hostname`` (the agent's host id there), or ``None``."""
        return next((n for n in await self._list({}) if n.hostname == hostname), None)

    async def _list(self, filters: Mapping[str, str]) -> list[SwarmNode]:
        try:
            raw = await self._docker().nodes.list(filters=dict(filters))
        except (aiodocker.DockerError, aiohttp.ClientError) as exc:
            raise BackendError(f"swarm manager at {self.engine}: list nodes: {exc}") from exc
        return sorted((SwarmNode.of(n) for n in raw), key=lambda n: n.hostname)

    async def by_hostname(self, hostname: str, label: str) -> SwarmNode | None:
        """The node named ``hostname`` among those with ``label``, or ``None``."""
        return next((n for n in await self.labelled(label) if n.hostname == hostname), None)

    async def set_availability(self, node: SwarmNode, availability: Availability) -> None:
        """Make ``node`` ``availability`` (at the version read: a node changed meanwhile
        is refused by the manager, as :class:`BackendError`)."""
        spec = {**node.spec, "Availability": availability}
        try:
            await self._docker().nodes.update(node_id=node.node_id, version=node.version, spec=spec)
        except (aiodocker.DockerError, aiohttp.ClientError) as exc:
            raise BackendError(
                f"swarm manager at {self.engine}: node {node.hostname} {availability}: {exc}"
            ) from exc
        log.info("swarm node %s (%s): %s", node.hostname, node.node_id[:12], availability)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _docker(self) -> aiodocker.Docker:
        if self._client is None:
            self._client = aiodocker.Docker(url=self.engine)
        return self._client
