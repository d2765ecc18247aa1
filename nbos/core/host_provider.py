"""The ``HostProvider`` interface: where the autoscaler's hosts come from and go back to.

A provider starts a host's ``nbos agent`` (a local process, a container on a Docker
engine, a command on a standby machine over SSH, a cloud API's new VM ...) so that
the agent registers with the gateway, and stops it once the gateway drained it.
Providers are registered under the entry point group ``nbos.host_providers``: a
name pointing at a factory that, called with the keyword arguments of
``[gateway] host_provider_options``, returns a ``HostProvider``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from nbos.core.ids import HostId


@attrs.frozen
class AgentCommand:
    """What the gateway tells a provider about the agent of a host it is to start.

    ``gateway``: where agents register (``HOST:PORT``); ``gpus``: virtual GPUs per
    host (``[cluster] gpus_per_host``), for providers whose hosts have no real ones
    (those of ``local``); ``heartbeat_s``: the agents' report
    interval; ``keys``: the key directory's path on the host (``""``: plain TCP);
    ``data_dir``: the gateway's run directory (providers on this machine keep
    agent state and logs there); ``settings``: a settings file in it holding the
    gateway's ``[agent]`` table, for agents on this machine (remote agents have their
    own settings).
    """

    gateway: str
    gpus: int
    heartbeat_s: float
    keys: str = ""
    data_dir: str = ""
    settings: str = ""

    def argv(
        self,
        host_id: HostId,
        address: str,
        state_dir: str,
        python: str,
        *,
        virtual: bool,
        settings: str = "",
    ) -> list[str]:
        """``nbos agent`` for ``host_id``, listening at ``address``, run by ``python``;
        ``virtual``: with :attr:`gpus` virtual GPUs, else the host's NVML GPUs;
        ``settings``: a file whose ``[agent]`` table the agent takes as it is.

        The agent stops its replicas when it stops: a host a provider takes back holds
        none (it was drained), and one torn down with the gateway must not leave any.
        """
        argv = [python, "-m", "nbos", "--log-level", "INFO", "agent", "--host", host_id]
        argv += ["--address", address, "--gateway", self.gateway, "--state-dir", state_dir]
        argv += ["--heartbeat", str(self.heartbeat_s), "--stop-replicas-on-exit"]
        if virtual:
            argv += ["--gpus", str(self.gpus)]
        if self.keys:
            argv += ["--keys", self.keys]
        if settings:
            argv += ["--agent-settings", settings]
        return argv


@runtime_checkable
class HostProvider(Protocol):
    """Adds hosts to the cluster and takes them away.

    * ``add_host`` starts a new host's agent as ``agent`` describes and returns the
      host's id (the provider names its hosts: a standby machine's name, a VM's) once
      the agent is started; the gateway then waits for it to register. It raises
      :class:`~nbos.core.errors.BackendError` (or
      :class:`~nbos.core.errors.HostUnreachableError`) when it cannot, e.g. a
      standby pool with no machine left.
    * ``remove_host`` stops a host it added (the gateway drained it first); a host
      it does not know is a no-op.
    * ``aclose`` stops every host it added.
    """

    @property
    def name(self) -> str:
        """The name the provider is registered under."""
        ...

    async def add_host(self, agent: AgentCommand) -> HostId: ...

    async def remove_host(self, host_id: HostId) -> None: ...

    async def aclose(self) -> None: ...
