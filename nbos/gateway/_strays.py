"""What a restarted gateway does with the replicas of no kernel it took back.

Once a gateway with a state file took back the kernels it names, the live hosts may
still run replicas that no kernel of it holds (a *stray*). Each replica carries its
owner (:class:`~nbos.core.wire.agent.ReplicaOwner`): the id of the gateway state that
started it and the generation that state's file had then, its kernel, node and Raft
address. That decides, on proof only:

* a replica of this state whose generation the file has reached (the file was written
  after the replica started and does not name it), or whose start the file names as
  never acknowledged, was dropped from the record: its kernel was shut down, the
  replica replaced, or its start never acknowledged. It is **stopped**;
* a replica of another state (the state file was lost, deleted or replaced: a new
  state id), or of a later generation than the file (the file is an older copy), belongs
  to a kernel this file has no record of. Its kernel is **adopted**: rebuilt from what
  the agents report of its replicas (their specs and connection files), taken back as
  :meth:`~nbos.gateway.KernelManager.restore` takes back a recorded one, with a front of
  fresh ports and key (its clients must connect again: the log names the kernel);
* a replica of such a kind whose kernel the gateway runs (the record names the kernel,
  not the replica), one without an owner (started by an older gateway or agent), and a
  group of fewer than a majority of its kernel's members cannot be adopted and are not
  proof of anything: they are **left running** and logged.
"""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from collections import defaultdict

from nbos.gateway._agent_backend import AgentBackend, Stray
from nbos.gateway._kernel import Kernel
from nbos.gateway._kernel_manager import KernelManager
from nbos.gateway._state import FrontRecord, GatewayState, KernelRecord, ReplicaRecord

log = logging.getLogger(__name__)


async def settle_strays(
    backend: AgentBackend,
    kernels: KernelManager,
    loaded: GatewayState,
    timeout: float,
) -> list[Kernel]:
    """Stop, adopt or leave the strays of ``backend``'s live hosts (see the module);
    ``loaded`` is the state file as the gateway found it. Returns the kernels adopted."""
    unacknowledged = {s.kernel_id for s in loaded.starting}
    running = {k.kernel_id for k in kernels.kernels}
    groups: dict[str, list[Stray]] = defaultdict(list)
    for stray in await backend.strays():
        owner = stray.info.owner
        if owner is None:
            _say(stray, "that no state names (started by an older nbos): left running")
        elif owner.state == loaded.state_id and owner.kernel_id in unacknowledged:
            what = f"of kernel {owner.kernel_id}, whose start was never acknowledged"
            _say(stray, f"{what}: stopping it")
            backend.stop_stray(stray)
        elif owner.state == loaded.state_id and owner.generation <= loaded.generation:
            _say(stray, f"of kernel {owner.kernel_id}, that its record dropped: stopping it")
            backend.stop_stray(stray)
        elif owner.kernel_id in running:
            _say(
                stray, f"of kernel {owner.kernel_id}, which its record does not name: left running"
            )
        elif stray.info.spec is None or not stray.connection:
            _say(
                stray,
                f"of kernel {owner.kernel_id}, whose spec or connection is unknown: left running",
            )
        else:
            groups[owner.kernel_id].append(stray)
    records = []
    for kernel_id, group in groups.items():
        record = _adoptable(kernel_id, group, kernels.options.front_ip)
        if record is not None:
            records.append(record)
    adopted = await kernels.restore(records, timeout) if records else []
    for kernel in adopted:
        log.warning(
            "kernel %s adopted from its replicas' reports: no state named it; its front "
            "has new ports and key, its clients must connect again",
            kernel.kernel_id,
        )
    return adopted


def _say(stray: Stray, what: str) -> None:
    info = stray.info
    log.warning("host %s runs replica %s (%s) %s", stray.host, info.replica_id, info.label, what)


def _adoptable(kernel_id: str, group: list[Stray], front_ip: str) -> KernelRecord | None:
    """``group``'s kernel as a record to take back, or ``None`` (logged, left running)
    when they are fewer than a majority of its members."""
    counts = [_members(s) for s in group]
    members = max((c for c in counts if c is not None), default=None)
    if members is None or None in counts or len(group) * 2 <= members:
        found = f"{len(group)} of {members if members is not None else 'unknown'} members"
        for stray in group:
            _say(stray, f"of kernel {kernel_id} ({found} found): not adopted; left running")
        return None
    replicas = sorted((_replica(s) for s in group), key=lambda r: r.node)
    front = FrontRecord(
        ip=front_ip,
        shell_port=0,
        iopub_port=0,
        stdin_port=0,
        control_port=0,
        hb_port=0,
        key=secrets.token_hex(32),
        session=uuid.uuid4().hex,
    )
    owners = [s.info.owner for s in group if s.info.owner is not None]
    gpus = max(o.gpus for o in owners)
    # The user every replica names; replicas that disagree give the kernel to the admins.
    users = {o.user for o in owners}
    user = users.pop() if len(users) == 1 else ""
    return KernelRecord(kernel_id=kernel_id, gpus=gpus, front=front, replicas=replicas, owner=user)


def _members(stray: Stray) -> int | None:
    """How many members the replica's kernel had when it started (its ``--raft-peers``);
    ``None`` where its argv does not say."""
    argv = stray.info.spec.argv if stray.info.spec is not None else []
    try:
        peers = json.loads(argv[argv.index("--raft-peers") + 1])
    except (ValueError, IndexError):
        return None
    return len(peers) if isinstance(peers, dict) else None


def _replica(stray: Stray) -> ReplicaRecord:
    spec, owner = stray.info.spec, stray.info.owner
    assert spec is not None and owner is not None  # only such strays are grouped
    return ReplicaRecord(
        node=owner.node,
        host=stray.host,
        process=stray.info.replica_id,
        workdir=spec.workdir,
        key=spec.connection_key,
        argv=list(spec.argv),
        raft=owner.raft,
        connection=dict(stray.connection),
        env=dict(spec.env),
        label=spec.label,
    )
