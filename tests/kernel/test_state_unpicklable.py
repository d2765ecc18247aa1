"""Values that cannot be pickled stay on the executor, are reported once, and block nothing."""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator

import pytest

from tests.kernel.conftest import Pair, sent_names

pytestmark = pytest.mark.anyio

UNPICKLABLE = {
    "fh": "open('/dev/null')",
    "sock": "__import__('socket').socket()",
    "gen": "(i for i in range(3))",
    "lock": "__import__('threading').Lock()",
    "nested": "[1, __import__('threading').Lock()]",
}


@pytest.fixture
def closing(pair: Pair) -> Iterator[Pair]:
    """The pair; closes the files and sockets its cells opened."""
    yield pair
    for value in list(pair.executor.values()):
        if isinstance(value, io.IOBase | socket.socket):
            value.close()


@pytest.mark.parametrize("name", sorted(UNPICKLABLE))
async def test_reported_once_and_other_names_still_sync(closing: Pair, name: str) -> None:
    pair = closing
    delta = await pair.cell(f"ok = [1, 2]\n{name} = {UNPICKLABLE[name]}")
    assert [n for n, _ in delta.unpicklable] == [name]
    assert "pickle" in delta.unpicklable[0][1]
    assert await sent_names(delta, pair.store) == {"ok"}
    assert name not in pair.replica and pair.replica["ok"] == [1, 2]

    delta = await pair.cell("ok.append(3)")
    assert delta.unpicklable == []  # told once
    assert pair.replica["ok"] == [1, 2, 3]


async def test_replica_drops_a_stale_value_and_gets_the_next_picklable_one(closing: Pair) -> None:
    pair = closing
    await pair.cell("fh = 1")
    delta = await pair.cell("fh = open('/dev/null')")
    assert [n for n, _ in delta.unpicklable] == ["fh"] and "fh" not in pair.replica
    delta = await pair.cell("fh.close()\nfh = 'closed'")
    assert delta.unpicklable == [] and pair.replica["fh"] == "closed"


async def test_a_new_unpicklable_value_under_the_same_name_is_reported_again(closing: Pair) -> None:
    pair = closing
    await pair.cell("lock = __import__('threading').Lock()")
    delta = await pair.cell("lock = __import__('threading').Lock()")
    assert [n for n, _ in delta.unpicklable] == ["lock"]


async def test_a_reduce_that_raises_anything_is_contained(pair: Pair) -> None:
    delta = await pair.cell(
        """
        class Bad:
            def __reduce__(self):
                raise RuntimeError("no")
        bad = Bad()
        good = 1
        """
    )
    assert delta.unpicklable == [("bad", "RuntimeError: no")]
    assert pair.replica["good"] == 1 and "Bad" in pair.replica


async def test_a_value_whose_pickle_does_not_load_is_kept_back(pair: Pair) -> None:
    delta = await pair.cell(
        """
        def explode():
            raise ValueError("cannot rebuild")
        class Boom:
            def __reduce__(self):
                return explode, ()
        boom = Boom()
        fine = [1]
        """
    )
    assert [n for n, _ in delta.unpicklable] == ["boom"]
    assert "does not load back" in delta.unpicklable[0][1]
    assert pair.replica["fine"] == [1] and "boom" not in pair.replica
    delta = await pair.cell("fine.append(2)")
    assert delta.unpicklable == [] and pair.replica["fine"] == [1, 2]


async def test_a_module_that_is_not_importable_by_name_stays(pair: Pair) -> None:
    delta = await pair.cell("import types\nfake = types.ModuleType('fake')\nheld = [fake]\nok = 1")
    assert sorted(n for n, _ in delta.unpicklable) == ["fake", "held"]
    assert pair.replica["ok"] == 1 and "fake" not in pair.replica


async def test_a_value_that_becomes_unpicklable_in_place_and_back(pair: Pair) -> None:
    await pair.cell("import threading\nlst = [1]")
    delta = await pair.cell("lst.append(threading.Lock())")
    assert [n for n, _ in delta.unpicklable] == ["lst"] and "lst" not in pair.replica
    delta = await pair.cell("lst.pop()")
    assert delta.unpicklable == [] and pair.replica["lst"] == [1]
