"""A kernel's state: one decision, from what the gateway knows of the kernel at the moment.

Every report of a kernel (``nbos status``, ``KernelInfo.state`` on the control API, the
``nbos_kernels_by_state`` metric, the Kernel Gateway API's ``nbos.state`` and its
``execution_state``) and the error a request gets from a kernel that cannot serve it come
from :func:`kernel_state` over :class:`KernelFacts`. The first rule that holds decides:

==============  ===========================================================================
state           when
==============  ===========================================================================
``dead``        it was shut down (or is being shut down); or fewer than a majority of its
                replicas are alive or unanswering, and none is being restarted in place
                or restored: nothing brings it back by itself (a replacement cannot: it
                joins through a majority)
``recovering``  a replica is being restarted in place or restored; or no majority is
                alive, but enough unanswering replicas (not known to have exited) would
                make one once they answer (suspicion is not proof); or a dead replica is
                being replaced while a majority runs the kernel
``starting``    its front has not yet heard every replica of its start
``waiting``     a cell waits to start (for GPUs, for a migration)
``busy``        a cell runs
``degraded``    a majority is alive, but not every replica
``idle``        every replica is alive and no cell is in progress
==============  ===========================================================================

A kernel without a majority of live replicas runs no cell: it is ``dead`` or
``recovering``, never ``idle``. A cell sent to it is refused at once (:func:`refusal`):
:class:`~nbos.core.errors.KernelDeadError` from a dead kernel (the cell ran nowhere),
:class:`~nbos.core.errors.QuorumLostError` from one that is recovering.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import attrs

from nbos.core.errors import KernelDeadError, QuorumLostError
from nbos.kernel.front import CellActivity

KernelState = Literal["starting", "idle", "busy", "waiting", "degraded", "recovering", "dead"]
#: Every state, in the order of the type.
KERNEL_STATES: tuple[KernelState, ...] = get_args(KernelState)
#: A kernel's ``execution_state`` in Jupyter's own words (those the Kernel Gateway API uses).
JupyterState = Literal["starting", "idle", "busy", "restarting", "dead"]


def _count(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, not {value}")


@attrs.frozen
class KernelFacts:
    """What the gateway knows of a kernel at one moment.

    ``members``: the replicas of its Raft membership that vote (a replacement still
    catching up is not one yet); ``alive``: those of them the front counts alive;
    ``unanswering``: those neither alive nor known to have exited (frozen, slow, or on a
    host that is silent: they may answer again); ``cell``: whether a cell is in progress,
    and whether it runs or waits to start; ``started``: the front heard every replica of
    its start; ``recovering``: a replica is being restarted in place or restored;
    ``replacing``: a dead replica is being replaced (not a live one moved: a migration);
    ``closed``: the kernel was shut down, or is being.
    """

    members: int = attrs.field(validator=_count)
    alive: int = attrs.field(validator=_count)
    unanswering: int = attrs.field(default=0, validator=_count)
    cell: CellActivity = "none"
    started: bool = True
    recovering: bool = False
    replacing: bool = False
    closed: bool = False

    def __attrs_post_init__(self) -> None:
        if self.alive + self.unanswering > self.members:
            raise ValueError(
                f"{self.alive} alive and {self.unanswering} unanswering replicas "
                f"of {self.members} members"
            )


def majority(count: int, members: int) -> bool:
    """Whether ``count`` replicas are a majority of ``members`` (the front's quorum)."""
    return count * 2 > members


def kernel_state(facts: KernelFacts) -> KernelState:
    """The kernel's state (the rules of the module's table, in its order)."""
    if facts.closed:
        return "dead"
    if facts.recovering:
        return "recovering"
    if not facts.started:
        return "starting"
    if not majority(facts.alive, facts.members):
        return "recovering" if majority(facts.alive + facts.unanswering, facts.members) else "dead"
    if facts.replacing:
        return "recovering"
    if facts.cell == "waiting":
        return "waiting"
    if facts.cell == "running":
        return "busy"
    if facts.alive < facts.members:
        return "degraded"
    return "idle"


def jupyter_state(state: KernelState, activity: str) -> JupyterState:
    """A kernel's ``execution_state`` for Jupyter clients, from its nbos ``state`` and the
    ``activity`` its IOPub last showed (``idle`` or ``busy``, as Jupyter Server reads it;
    ``restarting`` while the API restarts it).

    A kernel recovering shows ``busy``: it cannot take a cell now (or is mending), and a
    culler must not take it for an idle one; a degraded or idle one shows what its IOPub
    says, as any Jupyter kernel.
    """
    if activity == "restarting":
        return "restarting"
    match state:
        case "dead":
            return "dead"
        case "starting":
            return "starting"
        case "waiting" | "busy" | "recovering":
            return "busy"
        case "idle" | "degraded":
            return "busy" if activity == "busy" else "idle"


def refusal(kernel_id: str, facts: KernelFacts, account: str) -> QuorumLostError:
    """What a request is told that kernel ``kernel_id`` cannot serve for want of a majority
    of live replicas; ``account`` is the front's (``only replicas [2] of [1, 2, 3] are
    alive``)."""
    state = kernel_state(facts)
    if facts.closed:
        return KernelDeadError(f"kernel {kernel_id} is shut down")
    if state == "dead":
        return KernelDeadError(
            f"kernel {kernel_id} is dead: {account}, and none is being restarted or restored"
        )
    if facts.recovering:
        return QuorumLostError(
            f"kernel {kernel_id} is recovering: {account}; a replica is being restarted or "
            "restored: cells run again once a majority is back"
        )
    if facts.unanswering:
        return QuorumLostError(
            f"kernel {kernel_id}: {account}; {facts.unanswering} more do not answer but are "
            "not known to have exited: cells run again once a majority answers"
        )
    return QuorumLostError(f"kernel {kernel_id}: {account}")
