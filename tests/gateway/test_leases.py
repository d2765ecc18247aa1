"""Kernel leases: a kernel nobody watched for its lease is an orphan, but the time the
gateway itself was stalled (stopped, starved) counts against no lease."""

from __future__ import annotations

from nbos.gateway._leases import KernelLeases


def test_a_lease_nobody_renews_expires_after_its_time() -> None:
    leases = KernelLeases()
    leases.grant("k", 2.0, now=0.0)
    assert leases.expired(0.5, now=0.5) == []
    assert leases.expired(0.5, now=1.0) == []
    assert leases.expired(0.5, now=1.5) == []
    assert leases.expired(0.5, now=2.0) == []
    assert leases.expired(0.5, now=2.5) == ["k"]


def test_a_watched_kernel_never_expires() -> None:
    leases = KernelLeases()
    leases.grant("k", 1.0, now=0.0)
    with leases.watched("k"):
        assert all(leases.expired(0.5, now=t / 2) == [] for t in range(1, 20))


def test_time_the_gateway_was_stalled_is_not_the_owners_silence() -> None:
    leases = KernelLeases()
    leases.grant("k", 2.0, now=0.0)
    assert leases.expired(0.5, now=0.5) == []
    # The gateway was stopped for a minute: its next check comes ~60 s late. The owner's
    # watch requests wait in the socket, unread: its lease has not run out.
    assert leases.expired(0.5, now=61.0) == []
    # If the owner stays silent after the gateway is back, its lease runs out as usual.
    assert leases.expired(0.5, now=61.5) == []
    assert leases.expired(0.5, now=62.0) == []
    assert leases.expired(0.5, now=62.5) == ["k"]
