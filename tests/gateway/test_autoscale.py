"""Live autoscaling on an in-process ``nbos gateway`` with the ``local`` host provider.

A cell that waits for GPUs makes the autoscaler add a host (an ``nbos agent`` process),
the cell runs there once its replica moved; when the cluster is idle again a host is
drained (its replicas moved by learner catch-up) and removed, and the kernel's state
is intact: the same digest on every replica, the values still there.
"""

from __future__ import annotations

import signal
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest

from nbos.core.errors import ConfigError, PluginError
from nbos.core.host_provider import HostProvider
from nbos.core.ids import HostId, KernelId
from nbos.gateway import Grant
from nbos.gateway.providers import available_providers, load_host_provider
from nbos.gateway.service import GatewayService
from tests._wait import eventually
from tests.agent._daemons import DEADLINE, AgentProcess, start_agent
from tests.example_policy import install_example_policy
from tests.gateway._service import autoscaled_settings, local_settings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def test_a_waiting_cell_scales_out_and_an_idle_host_is_drained_with_state_intact(
    tmp_path: Path,
) -> None:
    settings = autoscaled_settings(tmp_path)
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        scheduler = service.directory.scheduler
        ledger = scheduler.ledger
        gateway = service.kernel_manager
        # Two kernels placed on the three first hosts; no GPUs of their own.
        kernel = await gateway.start_kernel(gpus=0)
        other = await gateway.start_kernel(gpus=0)
        assert (await kernel.execute("x = 40")).status == "ok"
        assert (await other.execute("z = 7")).status == "ok"
        # Something else holds one GPU of each host: no host has the 2 the cell asks for.
        hogs: list[Grant] = []
        for i, host in enumerate(sorted(h.host_id for h in scheduler.view().hosts), start=1):
            grant = await scheduler.acquire(
                KernelId(f"hog-{i}"), 1, {1: HostId(host)}, last_executor=None, gpus=1
            )
            hogs.append(await scheduler.committed(grant))

        waited = await kernel.execute("%%gpus 2\ny = x + 2", timeout=2 * DEADLINE)
        assert waited.status == "ok", waited.reply
        assert ledger.scale_outs >= 1 and ledger.migrations >= 1
        assert {h.host_id for h in scheduler.view().hosts} >= {"host-4"}
        cells = ledger.cells()
        cell = next(c for c in cells if c.kernel_id == kernel.kernel_id and c.gpus == 2)
        assert cell.started is not None and cell.started > cell.ready  # it waited for the host

        for grant in hogs:
            await scheduler.release(grant)
        before = {h.host_id for h in scheduler.view().hosts}
        autoscaler = service.autoscaler
        assert autoscaler is not None
        await eventually(
            lambda: (
                ledger.drain_moves >= 1
                and len(scheduler.view().hosts) == 3
                and not autoscaler.draining
            ),
            timeout=2 * DEADLINE,
        )
        gone = before - {h.host_id for h in scheduler.view().hosts}
        assert len(gone) == 1 and ledger.scale_ins >= 1

        for k, code, out in ((kernel, "print(y)", "42\n"), (other, "print(z)", "7\n")):
            assert not {r.host for r in k.replicas} & gone
            result = await k.execute(code)
            assert result.stdout == out, result.reply
            digests = await k.digests()
            assert len(digests) == 3 and len(set(digests.values())) == 1, digests


async def test_a_spare_host_is_added_while_every_host_has_gpus_committed_and_kept(
    tmp_path: Path,
) -> None:
    """``[gateway] spare_hosts = 1``: one GPU of each host is committed (load 0.5, below the
    scale-out threshold, and nothing waits), so no host could take a cell of 2 GPUs; a
    fourth host is added ahead of such a cell, and kept past its idle grace."""
    settings = autoscaled_settings(tmp_path)
    settings = msgspec.structs.replace(
        settings, gateway=msgspec.structs.replace(settings.gateway, spare_hosts=1)
    )
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        scheduler = service.directory.scheduler
        hosts = sorted(h.host_id for h in scheduler.view().hosts)
        assert len(hosts) == 3
        for i, host in enumerate(hosts, start=1):
            grant = await scheduler.acquire(
                KernelId(f"hog-{i}"), 1, {1: HostId(host)}, last_executor=None, gpus=1
            )
            await scheduler.committed(grant)
        await eventually(lambda: len(scheduler.view().hosts) == 4, timeout=2 * DEADLINE)
        assert scheduler.ledger.scale_outs == 1
        await anyio.sleep(3 * settings.gateway.idle_grace_s)
        assert len(scheduler.view().hosts) == 4 and scheduler.ledger.scale_ins == 0
        assert not scheduler.waiting()


async def test_autoscaler_keys_without_autoscale_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"gateway\.max_hosts"):
        async with GatewayService.serve(
            local_settings(tmp_path, max_hosts=9), shutdown_kernels_on_exit=True
        ):
            pass
    with pytest.raises(ConfigError, match=r"gateway\.spare_hosts"):
        async with GatewayService.serve(
            local_settings(tmp_path, spare_hosts=1), shutdown_kernels_on_exit=True
        ):
            pass
    with pytest.raises(ConfigError, match=r"gateway\.precopy"):  # its period runs it
        async with GatewayService.serve(
            local_settings(tmp_path, precopy=True), shutdown_kernels_on_exit=True
        ):
            pass
    with pytest.raises(
        PluginError, match=r"'no-such-provider' of entry point group 'nbos\.host_providers'"
    ):
        async with GatewayService.serve(
            local_settings(tmp_path, autoscale=True, host_provider="no-such-provider"),
            shutdown_kernels_on_exit=True,
        ):
            pass


async def test_a_user_package_registers_a_provider_the_gateway_scales_out_with(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = install_example_policy(tmp_path_factory, "host_provider")
    monkeypatch.syspath_prepend(str(site))
    assert {"local", "docker", "ssh", "example-vms"} <= set(available_providers())
    assert isinstance(load_host_provider("example-vms", quota=1), HostProvider)
    with pytest.raises(PluginError, match="zones"):
        load_host_provider("example-vms", zones=3)

    settings = local_settings(
        tmp_path,
        local_agents=False,
        autoscale=True,
        min_hosts=1,
        max_hosts=1,
        autoscale_period_s=0.3,
        host_provider="example-vms",
        host_provider_options={"quota": 1},
    )
    settings = msgspec.structs.replace(
        settings, cluster=msgspec.structs.replace(settings.cluster, replicas_per_kernel=1)
    )
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        # Below the floor of one host: the autoscaler asks the provider for one.
        await service.directory.scheduler.wait_for_host(HostId("vm-1"), 2 * DEADLINE)
        kernel = await service.kernel_manager.start_kernel(gpus=1)
        assert [r.host for r in kernel.replicas] == ["vm-1"]
        assert (await kernel.execute("%%gpus 1\nprint(6 * 7)")).stdout == "42\n"


def _connecting(agent: AgentProcess) -> bool:
    return "gateway tcp://" in agent.log_text()


async def test_agents_not_heard_from_yet_are_not_missing_from_the_floor(
    tmp_path: Path, agents: list[AgentProcess]
) -> None:
    """Agents started beside the gateway (a swarm's) that have not spoken when it starts:
    the first decision waits for the failure detector's window, so the floor of 3 is met
    by them and no host is added."""
    settings = local_settings(
        tmp_path,
        local_agents=False,
        autoscale=True,
        min_hosts=3,
        max_hosts=4,
        autoscale_period_s=0.3,
        scale_out_cooldown_s=0.0,
    )
    for host in ("h1", "h2", "h3"):
        agents.append(start_agent(host, settings.gateway.agent_address, tmp_path))
    for agent in agents:  # up, then slow to speak, as on a loaded node
        await eventually(partial(_connecting, agent), DEADLINE)
        agent.kill(signal.SIGSTOP)
    async with GatewayService.serve(settings, shutdown_kernels_on_exit=True) as service:
        scheduler = service.directory.scheduler
        await anyio.sleep(1.5)  # five periods
        for agent in agents:
            agent.kill(signal.SIGCONT)
        await scheduler.wait_for_hosts(3, DEADLINE)
        window = settings.gateway.heartbeat_s * settings.gateway.missed_heartbeats
        await anyio.sleep(window)  # the first decisions, made once they spoke
        assert scheduler.ledger.scale_outs == 0
        assert {h.host_id for h in scheduler.view().hosts} == {"h1", "h2", "h3"}
