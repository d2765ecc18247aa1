"""A cell's wait status: one display, shown once and then only updated in place."""

from __future__ import annotations

from typing import Any

import pytest

from nbos.kernel.front._status import WaitStatus

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_one_display_updated_in_place_and_never_shown_again_for_a_retry() -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    async def publish(msg_type: str, content: dict[str, Any]) -> None:
        sent.append((msg_type, content))

    clock = Clock()
    status = WaitStatus(publish, "nbos-wait-x", clock)
    await status.ended(started=True)
    assert sent == []  # a cell that never waited shows nothing
    await status.waits("nbos: the cell waits: a")
    clock.now += 1.5
    await status.waits("nbos: the cell waits: b")
    clock.now += 1.0
    await status.ended(started=True)
    # The front sends the cell again under a new index, and it waits again.
    await status.waits("nbos: the cell waits: c")
    clock.now += 0.25
    await status.ended(started=False)

    assert [t for t, _ in sent] == ["display_data"] + ["update_display_data"] * 4
    assert {c["transient"]["display_id"] for _, c in sent} == {"nbos-wait-x"}
    shown = [
        (
            c["data"]["text/plain"],
            c["metadata"]["nbos"]["status"],
            c["metadata"]["nbos"]["waited_s"],
        )
        for _, c in sent
    ]
    assert shown == [
        ("nbos: the cell waits: a", "waiting", 0.0),
        ("nbos: the cell waits: b", "waiting", 1.5),
        ("nbos: the cell started after waiting 2.5 s", "started", 2.5),
        ("nbos: the cell waits: c", "waiting", 0.0),
        ("nbos: the cell did not start (it waited 0.2 s)", "not started", 0.25),
    ]
