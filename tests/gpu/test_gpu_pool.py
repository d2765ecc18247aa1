"""Unit tests of one host's GPU pool accounting."""

from __future__ import annotations

import pytest

from nbos.core.errors import ConfigError, GpuError, InsufficientGpusError, UnknownReservationError
from nbos.core.ids import KernelId
from nbos.gpu import GpuPool, PoolCounts

from .conftest import ManualClock

A = KernelId("kernel-a")
B = KernelId("kernel-b")
TTL = 5.0


@pytest.fixture
def pool(clock: ManualClock) -> GpuPool:
    return GpuPool([0, 1, 2, 3], clock, TTL)


def test_precommit_then_commit_then_release(pool: GpuPool) -> None:
    pre = pool.precommit("r1", A, 2)
    assert pre.state == "precommitted" and len(pre.devices) == 2
    assert pool.counts() == PoolCounts(total=4, idle=2, precommitted=2, committed=0)
    com = pool.commit("r1")
    assert com.state == "committed" and com.devices == pre.devices
    assert pool.counts() == PoolCounts(total=4, idle=2, precommitted=0, committed=2)
    assert pool.release("r1") == pre.devices
    assert pool.counts() == PoolCounts(total=4, idle=4, precommitted=0, committed=0)


def test_commit_and_release_are_idempotent(pool: GpuPool) -> None:
    pool.precommit("r1", A, 1)
    first = pool.commit("r1")
    assert pool.commit("r1") == first
    assert pool.commit("r1", A, 1) == first
    devices = pool.release("r1")
    assert pool.release("r1") == devices
    # A duplicate commit arriving after the release must not bind the devices again.
    late = pool.commit("r1")
    assert late.state == "released"
    assert pool.counts().idle == 4
    assert pool.precommit("r1", A, 1).state == "released"
    assert pool.counts().idle == 4


def test_release_of_unknown_reservation_is_a_no_op(pool: GpuPool) -> None:
    assert pool.release("never") == ()
    assert pool.counts().idle == 4


def test_insufficient_gpus_changes_nothing(pool: GpuPool) -> None:
    pool.precommit("r1", A, 3)
    with pytest.raises(InsufficientGpusError) as err:
        pool.precommit("r2", B, 2)
    assert (err.value.requested, err.value.available) == (2, 1)
    assert pool.counts() == PoolCounts(total=4, idle=1, precommitted=3, committed=0)
    assert pool.lookup("r2") is None


def test_direct_commit_without_precommit(pool: GpuPool) -> None:
    alloc = pool.commit("r1", A, 3)
    assert alloc.state == "committed" and len(alloc.devices) == 3
    with pytest.raises(UnknownReservationError) as err:
        pool.commit("r2")
    assert err.value.why == "unknown"


def test_reusing_a_reservation_id_for_another_kernel_is_refused(pool: GpuPool) -> None:
    pool.precommit("r1", A, 1)
    with pytest.raises(GpuError):
        pool.precommit("r1", B, 1)
    with pytest.raises(GpuError):
        pool.commit("r1", A, 2)
    assert pool.counts().precommitted == 1


def test_precommit_expires_after_ttl(pool: GpuPool, clock: ManualClock) -> None:
    pool.precommit("old", A, 1)
    pool.commit("running", B, 1)
    clock.advance(TTL - 0.1)
    pool.precommit("young", A, 1)
    assert pool.expire() == ()
    clock.advance(0.1)
    expired = pool.expire()
    assert [a.reservation_id for a in expired] == ["old"]
    assert pool.counts() == PoolCounts(total=4, idle=2, precommitted=1, committed=1)
    with pytest.raises(UnknownReservationError) as err:
        pool.commit("old")
    assert err.value.why == "expired"
    # A cell that arrives late re-acquires fresh devices under the same id.
    assert pool.commit("old", A, 1).state == "committed"
    assert pool.counts() == PoolCounts(total=4, idle=1, precommitted=1, committed=2)


def test_release_kernel_frees_only_that_kernel(pool: GpuPool) -> None:
    pool.precommit("a1", A, 1)
    pool.commit("a2", A, 1)
    pool.commit("b1", B, 1)
    pool.release("b1", resident=True)
    pool.commit("a3", A, 1)
    pool.release("a3", resident=True)
    freed = pool.release_kernel(A)
    assert sorted(a.reservation_id for a in freed) == ["a1", "a2"]
    assert pool.counts() == PoolCounts(total=4, idle=4, precommitted=0, committed=0)
    assert set(pool.resident().values()) == {B}
    assert pool.release("a2") != ()  # remembered as released, still idempotent


def test_same_kernel_prefers_its_resident_devices(pool: GpuPool) -> None:
    pool.commit("a1", A, 4)
    pool.release("a1")
    first = pool.commit("a2", A, 1)
    pool.release("a2", resident=True)
    pool.commit("b1", B, 1)  # must avoid A's resident device
    again = pool.precommit("a3", A, 1)
    assert again.devices == first.devices
    assert again.evict_from == {}


def test_evict_first_kernels_lose_their_devices_before_other_kernels(pool: GpuPool) -> None:
    pool.commit("b1", B, 2)
    pool.commit("a1", A, 2)
    pool.release("b1", resident=True)
    pool.release("a1", resident=True)
    assert pool.resident() == {0: B, 1: B, 2: A, 3: A}
    # By default the lowest device (B's) goes; A named first (its user borrows): A's.
    assert pool.precommit("c1", KernelId("c"), 1).evict_from == {0: B}
    taken = pool.commit("c2", KernelId("c"), 2, evict_first={A})
    assert taken.evict_from == {2: A, 3: A}
    # Free devices still go before anyone's resident ones.
    pool.release("c2")
    assert pool.precommit("c3", KernelId("c"), 1, evict_first={B}).devices == (2,)


def test_foreign_resident_device_reports_who_evicts(pool: GpuPool) -> None:
    pool.commit("a1", A, 3)
    pool.release("a1", resident=True)
    resident = set(pool.resident())
    alloc = pool.precommit("b1", B, 2)
    free = set(pool.devices) - resident
    assert free <= set(alloc.devices)  # the clean device goes first
    assert alloc.evict_from == {d: A for d in alloc.devices if d in resident}
    assert len(alloc.evict_from) == 1
    assert pool.commit("b1").evict_from == alloc.evict_from
    # Once handed to B, the device no longer counts as holding A's tensors.
    assert set(pool.resident()) == resident - set(alloc.devices)
    pool.evicted(A)
    assert pool.resident() == {}


def test_restore_from_committed_report(pool: GpuPool, clock: ManualClock) -> None:
    pool.commit("a1", A, 2)
    pool.precommit("b1", B, 1)
    stale = {d: B for d in pool.committed()[0].devices}
    resident = {d: A for d in pool.idle_devices()[:1]}
    restored = GpuPool.restore(pool.devices, clock, TTL, pool.committed(), stale | resident)
    assert restored.counts() == PoolCounts(total=4, idle=2, precommitted=0, committed=2)
    assert restored.resident() == resident
    assert restored.commit("a1") == pool.commit("a1")
    with pytest.raises(UnknownReservationError):
        restored.commit("b1")


def test_restore_rejects_a_report_that_binds_a_device_twice(
    pool: GpuPool, clock: ManualClock
) -> None:
    one = pool.commit("a1", A, 1)
    twin = type(one)("b1", B, one.devices, "committed", 0.0)
    with pytest.raises(GpuError):
        GpuPool.restore(pool.devices, clock, TTL, [one, twin])
    stranger = type(one)("c1", B, (9,), "committed", 0.0)
    with pytest.raises(GpuError):
        GpuPool.restore(pool.devices, clock, TTL, [stranger])
    pending = pool.precommit("p1", B, 1)
    with pytest.raises(GpuError):
        GpuPool.restore(pool.devices, clock, TTL, [pending])


def test_finished_reservations_are_remembered_up_to_a_bound(clock: ManualClock) -> None:
    pool = GpuPool([0, 1], clock, TTL, tombstones=2)
    released = []
    for rid in ("r1", "r2", "r3"):
        pool.commit(rid, A, 1)
        released.append(pool.release(rid))
    assert pool.release("r3") == released[2] != ()
    assert pool.release("r2") == released[1]
    assert pool.release("r1") == ()  # forgotten: still a no-op
    assert pool.counts().idle == 2


@pytest.mark.parametrize(
    ("devices", "ttl"), [([0, 0], 1.0), ([-1], 1.0), ([0], 0.0), ([0], float("nan"))]
)
def test_bad_configuration_is_a_config_error(
    devices: list[int], ttl: float, clock: ManualClock
) -> None:
    with pytest.raises(ConfigError):
        GpuPool(devices, clock, ttl)


def test_negative_count_is_refused(pool: GpuPool) -> None:
    with pytest.raises(GpuError):
        pool.precommit("r1", A, -1)
    assert pool.counts().idle == 4


def test_negative_tombstone_bound_is_a_config_error(clock: ManualClock) -> None:
    with pytest.raises(ConfigError):
        GpuPool([0], clock, TTL, tombstones=-1)
