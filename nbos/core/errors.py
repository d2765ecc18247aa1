"""The nbos error hierarchy.

Every error that nbos raises on purpose derives from :class:`NbosError`, so an
embedding application can catch one type at its boundary. Subclasses carry the
facts a caller needs as attributes, not only in the message text.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Sequence
from typing import Any


class NbosError(Exception):
    """Root of every error nbos raises on purpose."""


# --- configuration -------------------------------------------------------------


class ConfigError(NbosError):
    """A setting has a bad value; names the key, the value and what was expected."""

    def __init__(self, key: str, value: Any, expected: str) -> None:
        self.key = key
        self.value = value
        self.expected = expected
        super().__init__(f"bad config value for {key!r}: {value!r} (expected {expected})")


class PluginError(ConfigError):
    """A plug-in (an entry point of an ``nbos.*`` group) cannot be used; names the group,
    the name and the cause: an unknown name (``known`` lists the registered ones), a name
    two distributions register, an import that failed, options the factory refused, or
    an object that does not satisfy the group's Protocol.

    A :class:`ConfigError` because a plug-in is always chosen by a name, in the settings
    (``[cluster] placement_policy``, ``[store] kind``, ``[gateway] host_provider``) or
    in code, and what fixes it is that name or what is installed, never a retry: it is refused
    where bad settings are (at start, an HTTP 400), not taken for a full cluster or an
    unreachable host. ``key`` is the group, ``value`` the name, ``expected`` the cause.
    """

    def __init__(self, group: str, name: str, cause: str, known: Sequence[str] = ()) -> None:
        self.group = group
        self.name = name
        self.cause = cause
        self.known = list(known)
        self.key, self.value, self.expected = group, name, cause
        # Not ConfigError's message: the group is not a settings key.
        NbosError.__init__(self, f"plug-in {name!r} of entry point group {group!r}: {cause}")


# --- wire ----------------------------------------------------------------------


class DecodeError(NbosError):
    """Bytes from a wire or a log could not be decoded into a known message."""


class AuthenticationError(NbosError):
    """A message or peer failed authentication (wrong HMAC signature, wrong CURVE key)."""


# --- users -------------------------------------------------------------------------


class UnauthorizedError(NbosError):
    """A request came without credentials, or with ones no identity provider knows."""


class ForbiddenError(NbosError):
    """An authenticated user asked for what only an admin may do."""


class IdentityProviderError(NbosError):
    """An identity provider could not tell who a token belongs to (a Hub that does not
    answer): the request is refused, as unauthenticated, and may be tried again."""


# --- transports ----------------------------------------------------------------


class TransportError(NbosError):
    """A transport could not carry out a request."""


class TransportClosedError(TransportError):
    """The transport was closed; no more sends or receives are possible."""


class UnknownPeerError(TransportError):
    """A message was addressed to a peer the transport has no address for."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        super().__init__(f"unknown peer {peer!r}")


class JoinRefusedError(NbosError):
    """The gateway refused an agent's join (``docs/deploy.md``, "Join token"); ``kind`` is
    the refusal's (``bad_proof``, ``expired``, ``replayed``, ``host_taken``, ``malformed``)."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)


# --- object stores -------------------------------------------------------------


class StoreError(NbosError):
    """An object store could not carry out a request."""


class BlobNotFoundError(StoreError):
    """No blob is stored under the key."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"no blob stored under {key!r}")


class BlobCorruptError(StoreError):
    """A stored blob's content does not hash to its key."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"blob {key!r} does not match its content hash")


class InvalidBlobKeyError(StoreError):
    """A key is not ``"sha256:"`` followed by 64 lowercase hex digits.

    Refused before any lookup, so a key can never name a path or a backend key
    outside the store.
    """

    def __init__(self, key: object) -> None:
        self.key = key
        super().__init__(
            f"invalid blob key {key!r}: expected 'sha256:' followed by 64 lowercase hex digits"
        )


# --- replication ---------------------------------------------------------------


class ReplicationError(NbosError):
    """The replicated log could not carry out a request."""


class NotLeaderError(ReplicationError):
    """This node is not the leader; ``leader_hint`` names the one it knows of, if any."""

    def __init__(self, leader_hint: int | None) -> None:
        self.leader_hint = leader_hint
        hint = f"; try node {leader_hint}" if leader_hint is not None else "; leader unknown"
        super().__init__(f"not the leader{hint}")


class ProposalTimeoutError(ReplicationError):
    """A proposal was not committed and applied within its deadline.

    The entry may still commit later: callers that retry must reuse the same
    client id and sequence number so that it applies once.
    """


class LogClosedError(ReplicationError):
    """The replicated log has shut down."""


class StorageCorruptError(ReplicationError):
    """Durable Raft state failed its checksums in a place that cannot be a torn tail."""


class RaftStateMissingError(ReplicationError):
    """A member restarted in place found no Raft state where it kept it: its disk lost it.

    Bootstrapping afresh there would forget votes and acknowledged entries, so it does not.
    """


class MembershipChangeError(ReplicationError):
    """A membership change was refused (another change is in progress, unknown node, ...)."""


# --- kernels -------------------------------------------------------------------


class KernelError(NbosError):
    """A replicated kernel could not carry out a request."""


class UnknownKernelError(KernelError):
    """No kernel with this id exists."""

    def __init__(self, kernel_id: str) -> None:
        self.kernel_id = kernel_id
        super().__init__(f"unknown kernel {kernel_id!r}")


class CellLostError(KernelError):
    """The replica executing a cell died before the cell's ``Done`` committed."""

    def __init__(self, exec_index: int, replica: int) -> None:
        self.exec_index = exec_index
        self.replica = replica
        super().__init__(
            f"cell {exec_index} was lost: its executor (replica {replica}) died mid-cell; "
            "the kernel keeps the state of the last completed cell"
        )


class QuorumLostError(KernelError):
    """Fewer than a majority of a kernel's replicas are alive."""


class KernelDeadError(QuorumLostError):
    """The kernel cannot run a cell and nothing is bringing it back: it was shut down, or
    fewer than a majority of its replicas are alive or unanswering (not known to have
    exited) and no restart, replacement or restore is under way. A request it answers
    with this error was not run anywhere."""


class ReplacementError(KernelError):
    """The cluster gave up replacing a dead replica of a kernel, after every retry."""

    def __init__(self, kernel_id: str, replica: int, attempts: int, last: str) -> None:
        self.kernel_id = kernel_id
        self.replica = replica
        self.attempts = attempts
        super().__init__(
            f"kernel {kernel_id}: replica {replica} not replaced in {attempts} attempts "
            f"(last: {last})"
        )


# --- GPUs and placement --------------------------------------------------------


class GpuError(NbosError):
    """GPU inventory or accounting failed."""


class InsufficientGpusError(GpuError):
    """A request asks for more GPUs than can be committed."""

    def __init__(self, requested: int, available: int, where: str) -> None:
        self.requested = requested
        self.available = available
        self.where = where
        super().__init__(f"{where}: asked for {requested} GPUs, {available} can be committed")


class UnknownReservationError(GpuError):
    """A GPU reservation is not held: never made, expired (``why="expired"``) or lost."""

    def __init__(self, reservation_id: str, why: str) -> None:
        self.reservation_id = reservation_id
        self.why = why
        super().__init__(f"GPU reservation {reservation_id!r} is not held ({why})")


class PlacementError(NbosError):
    """No placement satisfies the request."""


class OverloadedError(PlacementError):
    """The cluster takes no more kernels now: as many starts as ``[gateway] max_starting``
    are under way (and none ended within ``start_wait_s``), or no host has room for the
    replicas (``[cluster] max_replicas_per_host``, ``min_free_memory_mib``). Refused
    hurting nothing that runs; ask again after ``retry_after_s`` seconds (HTTP: 503 with
    ``Retry-After``; control API: ``ControlError(kind="overloaded")``).

    A :class:`PlacementError`, so that who caught a full cluster still catches it.
    """

    def __init__(self, reason: str, retry_after_s: float) -> None:
        self.reason = reason
        self.retry_after_s = retry_after_s
        super().__init__(f"{reason}: ask again in {retry_after_s:g} s")


class PolicyContractError(PlacementError):
    """A placement policy answered with hosts it may not choose (too few, repeated,
    unknown, excluded, unschedulable, or without the idle GPUs a target needs): a bug
    in the policy, not a full cluster."""


# --- durable state -------------------------------------------------------------


class StateWriteError(NbosError):
    """The gateway's state could not be written to disk (``ENOSPC``, ``EIO`` ...): what it
    was to record is not acknowledged. Names the file and the ``errno``."""

    def __init__(self, path: str, cause: OSError) -> None:
        self.path = path
        self.errno = cause.errno
        name = errno_name(cause.errno)
        super().__init__(f"gateway state not written to {path}: {name} ({cause.strerror or cause})")


def errno_name(code: int | None) -> str:
    """``ENOSPC`` for 28; ``errno N`` for a number without a name, ``no errno`` for none."""
    if code is None:
        return "no errno"
    return _errno.errorcode.get(code, f"errno {code}")


# --- backends ------------------------------------------------------------------


class BackendError(NbosError):
    """A compute backend could not start, reach or stop a process."""


class HostUnreachableError(BackendError):
    """A host stopped answering or was never reachable."""

    def __init__(self, host: str, reason: str) -> None:
        self.host = host
        super().__init__(f"host {host!r} is unreachable: {reason}")


# --- scaling -------------------------------------------------------------------


class ScalingError(NbosError):
    """The autoscaler or the simulator got input it cannot use (time going
    backwards, a malformed cluster view, a bad trace)."""


# --- chaos ---------------------------------------------------------------------


class NemesisUnsupportedError(NbosError):
    """A chaos nemesis needs something the cluster under test does not have (a gateway ...)."""

    def __init__(self, nemesis: str, missing: Sequence[str], cluster: str) -> None:
        self.nemesis = nemesis
        self.missing = list(missing)
        super().__init__(
            f"nemesis {nemesis!r} needs {', '.join(missing)}, which the {cluster} does not have"
        )
