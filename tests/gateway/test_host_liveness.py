"""The one failure detector for hosts: silence past the timeout is suspicion, but not the
silence the detector caused by checking late (a paused or starved gateway)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nbos.core.ids import HostId
from nbos.gateway._host_liveness import MAX_STRETCH, SilenceDetector

A, B = HostId("a"), HostId("b")


def checks(detector: SilenceDetector, start: float, end: float) -> list[tuple[float, HostId]]:
    """Check on time from ``start`` to ``end``; when each host was suspected."""
    found = []
    t = start
    while t <= end:
        found += [(t, host) for host, _ in detector.silent(t)]
        t += detector.interval
    return found


def test_a_host_silent_past_the_timeout_is_suspected_once_until_heard_again() -> None:
    d = SilenceDetector(timeout=4.0)
    d.heard(A, 0.0)
    d.heard(B, 0.0)
    for t in (1.0, 2.0, 3.0, 4.0):
        d.heard(B, t)
    found = checks(d, 1.0, 12.0)
    assert found == [(5.0, A), (9.0, B)]
    d.heard(A, 12.5)
    assert checks(d, 13.0, 16.0) == []
    assert checks(d, 17.0, 17.0) == [(17.0, A)]


def test_time_the_detector_was_stalled_is_nobodys_silence() -> None:
    d = SilenceDetector(timeout=4.0)
    d.heard(A, 0.0)
    assert d.silent(1.0) == []
    # The gateway was stopped for 30 s: the next check comes 29 s late. The host spoke
    # meanwhile, unheard (its messages wait in the socket): it is not suspected.
    assert d.silent(31.0) == []
    d.heard(A, 31.2)
    assert checks(d, 32.0, 35.0) == []


def test_after_a_stall_a_host_that_stays_silent_is_suspected_a_timeout_later() -> None:
    d = SilenceDetector(timeout=4.0)
    d.heard(A, 0.0)
    d.silent(1.0)
    # 29 s late: only the 2 s of silence the detector saw count, as if A spoke at 29 s
    assert d.silent(31.0) == []
    assert checks(d, 32.0, 40.0) == [(34.0, A)]


def test_a_forgotten_host_is_never_suspected() -> None:
    d = SilenceDetector(timeout=4.0)
    d.heard(A, 0.0)
    d.forget(A)
    assert checks(d, 1.0, 20.0) == []


def test_a_host_whose_heartbeats_come_irregularly_gets_longer_before_it_is_suspected() -> None:
    d = SilenceDetector(timeout=4.0)
    t = 0.0
    for gap in [1.0, 3.0, 0.5, 3.5, 1.0, 3.0] * 4:  # a loaded host: late, then bunched
        t += gap
        d.heard(A, t)
        d.heard(B, t)
        d.silent(t)
    d.heard(B, t + 0.5)  # B beat as irregularly, and once more; A falls silent now
    assert d.limit(A) > 2 * d.timeout
    # A silence a regular host would be suspected for is not suspicious for this one.
    assert [host for _, host in checks(d, t + 0.25, t + 2 * d.timeout)] == []
    # But it does not wait forever: at most MAX_STRETCH timeouts.
    found = checks(d, t + 2 * d.timeout, t + (MAX_STRETCH + 1) * d.timeout)
    assert {host for _, host in found} == {A, B}


def test_a_host_that_beats_like_a_clock_is_suspected_after_the_timeout() -> None:
    d = SilenceDetector(timeout=4.0)
    for t in range(10):
        d.heard(A, float(t))
        d.silent(float(t))
    assert d.limit(A) == d.timeout
    assert checks(d, 10.0, 15.0) == [(14.0, A)]


@given(st.lists(st.floats(0.01, 30.0), min_size=2, max_size=80))
def test_the_limit_is_never_below_the_timeout_nor_past_its_stretch(gaps: list[float]) -> None:
    d = SilenceDetector(timeout=4.0)
    t = 0.0
    for gap in gaps:
        t += gap
        d.heard(A, t)
    assert d.timeout <= d.limit(A) <= MAX_STRETCH * d.timeout
