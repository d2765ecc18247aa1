"""The executor role moves between replicas: each side captures and applies in turn."""

from __future__ import annotations

import pytest

from nbos.kernel.state import StateCapture, apply, namespace_digest
from nbos.store.local import LocalObjectStore
from tests.kernel.conftest import fresh_namespace, sent_names

pytestmark = pytest.mark.anyio


async def test_alternating_executors_stay_equal_and_send_only_changes(
    store: LocalObjectStore,
) -> None:
    spaces = [fresh_namespace(), fresh_namespace()]
    captures = [StateCapture(store), StateCapture(store)]
    cells = [
        "import numpy as np\nbig = np.ones(300_000)\nitems = [1]\nclass K:\n    pass\nk = K()",
        "items.append(2)",
        "big[0] = 5.0\nk.tag = 'x'",
        "del items",
    ]
    for index, code in enumerate(cells, start=1):
        executor, other = index % 2, 1 - index % 2
        exec(compile(code, "<cell>", "exec", dont_inherit=True), spaces[executor])
        delta = await captures[executor].capture(spaces[executor], index)
        await apply(spaces[other], delta, store)
        await captures[other].baseline(spaces[other])
        assert namespace_digest(spaces[other]) == namespace_digest(spaces[executor])
        if index == 2:
            assert await sent_names(delta, store) == {"items"}  # not big, k or K again
        if index == 3:
            assert await sent_names(delta, store) == {"big", "k", "K"}
    assert "items" not in spaces[0] and spaces[0]["big"][0] == 5.0
    assert type(spaces[0]["k"]) is spaces[0]["K"] and spaces[0]["k"].tag == "x"


async def test_without_a_baseline_a_new_executor_resends_what_it_applied(
    store: LocalObjectStore,
) -> None:
    first, second = fresh_namespace(), fresh_namespace()
    exec("a = [1]\nb = {'k': 2}", first)
    await apply(second, await StateCapture(store).capture(first, 1), store)
    exec("c = 3", second)
    delta = await StateCapture(store).capture(second, 2)
    assert await sent_names(delta, store) == {"a", "b", "c"}  # more than needed, never less
