"""Whether each host's agent answers: hosts that stop reporting are marked unreachable.

An unreachable host is left out of executor choice and placement (the cluster model
shows it unschedulable) until its agent reports again; nothing it holds is freed on
suspicion alone (design, "The control plane: suspicion is not proof").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio

from nbos.gateway._hosts import HostRecord, Hosts

log = logging.getLogger(__name__)


class HostLiveness:
    """Marks hosts unreachable when their agents fall silent; run :meth:`run` in a task."""

    def __init__(self, hosts: Hosts, host_timeout: float, notify: Callable[[], None]) -> None:
        self._hosts = hosts
        self._timeout = host_timeout
        self._notify = notify

    async def run(self) -> None:
        """Check every quarter of ``host_timeout`` for hosts silent longer than that."""
        while True:
            await anyio.sleep(self._timeout / 4)
            now = anyio.current_time()
            for host in self._hosts.records():
                if host.reachable and now - host.last_seen > self._timeout:
                    self.unreachable(host, f"no report for {now - host.last_seen:.1f} s")

    def unreachable(self, host: HostRecord, why: str) -> None:
        if host.reachable:
            self._hosts.set_reachable(host, False)
            log.warning(
                "host %s is unreachable (%s): not schedulable until it reports again",
                host.host_id,
                why,
            )
            self._notify()

    def reported(self, host: HostRecord, was_reachable: bool) -> None:
        """The host's agent reported (its record is up to date): it is reachable again."""
        if not was_reachable:
            log.info("host %s is reachable again", host.host_id)
        self._hosts.set_reachable(host, True)
