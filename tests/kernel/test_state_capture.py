"""Capture and apply of plain values: new, rebound, mutated, deleted, imported names."""

from __future__ import annotations

import functools
import io
import os.path
from typing import Any

import pytest

from nbos.core.wire import decode, encode
from nbos.core.wire.state import StateDelta
from nbos.kernel.state import is_user_name
from tests.kernel.conftest import Pair, sent_names

pytestmark = pytest.mark.anyio


async def test_new_rebound_and_deleted_names(pair: Pair) -> None:
    delta = await pair.cell("x = 1\ny = 'two'\nz = [3.0, None, (4, 5)]")
    assert await sent_names(delta, pair.store) == {"x", "y", "z"}
    assert pair.replica["z"] == [3.0, None, (4, 5)]

    delta = await pair.cell("x = 10")
    assert await sent_names(delta, pair.store) == {"x"}
    assert pair.replica["x"] == 10

    delta = await pair.cell("del y")
    assert delta.deleted == ["y"]
    assert "y" not in pair.replica


async def test_unchanged_namespace_gives_an_empty_delta(pair: Pair) -> None:
    await pair.cell("a = {'k': [1, 2]}\nb = 3")
    delta = await pair.cell("pass")
    assert delta == StateDelta(exec_index=2)


@pytest.mark.parametrize(
    ("setup", "mutation", "name"),
    [
        ("a = [1]", "a.append(2)", "a"),
        ("d = {'k': 1}", "d['k'] = 2", "d"),
        ("d = {'k': [1]}", "d['k'].append(2)", "d"),
        ("s = {1, 2}", "s.discard(1)", "s"),
        ("class O: pass\no = O()", "o.attr = 5", "o"),
        ("import numpy\narr = numpy.zeros(8)", "arr[3] = 1.5", "arr"),
        ("ba = bytearray(b'abc')", "ba[0] = 0", "ba"),
    ],
)
async def test_in_place_mutation_is_detected(
    pair: Pair, setup: str, mutation: str, name: str
) -> None:
    await pair.cell(setup)
    delta = await pair.cell(mutation)
    assert name in await sent_names(delta, pair.store)


async def test_imports_travel_by_name(pair: Pair) -> None:
    delta = await pair.cell(
        "import numpy as np\nfrom os import path\nfrom os.path import join\nimport json"
    )
    assert sorted(delta.imports) == [("json", "json"), ("np", "numpy"), ("path", "posixpath")]
    assert b"numpy" not in delta.set  # modules are not pickled
    assert pair.replica["path"] is os.path
    assert pair.replica["join"] is os.path.join  # a library function: by reference
    delta = await pair.cell("np = 5")  # a module name rebound to a value
    assert delta.imports == []
    assert pair.replica["np"] == 5


async def test_ipython_bookkeeping_names_are_not_state(pair: Pair) -> None:
    pair.executor.update({"_": 42, "_i7": "x", "_7": 1, "Out": {7: 1}, "_oh": {}, "__doc__": "d"})
    delta = await pair.cell("_items = [1]")
    assert await sent_names(delta, pair.store) == {"_items"}
    assert pair.replica["_"] is None and pair.replica["Out"] == {}


@pytest.mark.parametrize("name", ["_", "__", "___", "_i", "_ii", "_iii", "_i12", "_12", "In", "Out",
                                  "_oh", "_ih", "_dh", "get_ipython", "exit", "quit",
                                  "__builtins__", "__name__", "__spec__"])  # fmt: skip
def test_bookkeeping_names(name: str) -> None:
    assert not is_user_name(name)


@pytest.mark.parametrize("name", ["x", "_x", "_items", "_i_x", "in_", "__x", "x__", "_1a"])
def test_user_names(name: str) -> None:
    assert is_user_name(name)


async def test_delta_travels_through_the_wire_codec(pair: Pair) -> None:
    delta = await pair.cell("import math\nv = [1, 2]\nf = open('/dev/null')")
    pair.executor["f"].close()
    assert decode(encode(delta)) == delta
    assert delta.unpicklable and delta.imports and delta.set


async def test_ipythons_open_wrapper_is_not_state_but_a_users_open_is(pair: Pair) -> None:
    @functools.wraps(io.open)
    def ipython_open(*args: Any, **kwargs: Any) -> Any:
        return open(*args, **kwargs)

    pair.executor["open"] = pair.replica["open"] = ipython_open
    delta = await pair.cell("v = 1")
    assert delta.unpicklable == [] and await sent_names(delta, pair.store) == {"v"}
    assert pair.replica["open"] is ipython_open
    delta = await pair.cell("open = 'mine'")
    assert await sent_names(delta, pair.store) == {"open"}
