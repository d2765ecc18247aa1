"""Shared references: names bound to one object stay bound to one object on the replica."""

from __future__ import annotations

import pytest

from tests.kernel.conftest import Pair, sent_names

pytestmark = pytest.mark.anyio


async def test_two_names_one_object(pair: Pair) -> None:
    await pair.cell("a = [1]\nb = a\nd = {'x': a}")
    r = pair.replica
    assert r["a"] is r["b"] is r["d"]["x"]
    await pair.cell("a.append(2)")
    assert r["a"] is r["b"] is r["d"]["x"] and r["b"] == [1, 2]


async def test_a_new_alias_brings_its_whole_group(pair: Pair) -> None:
    await pair.cell("a = [1]\nb = a\nunrelated = [0]")
    delta = await pair.cell("c = b")
    assert await sent_names(delta, pair.store) == {"a", "b", "c"}
    assert pair.replica["c"] is pair.replica["a"]


async def test_breaking_an_alias_with_an_equal_copy(pair: Pair) -> None:
    await pair.cell("a = [1]\nb = a")
    delta = await pair.cell("b = list(a)")
    assert "b" in await sent_names(delta, pair.store)
    assert pair.replica["a"] is not pair.replica["b"]
    await pair.cell("b.append(2)")
    assert pair.replica["a"] == [1]


async def test_sharing_of_inner_objects_changes_without_changing_bytes(pair: Pair) -> None:
    await pair.cell("d = {'k': [1]}\ne = d['k']")
    assert pair.replica["e"] is pair.replica["d"]["k"]
    await pair.cell("d['k'] = [1]")  # same pickle bytes for d, but e is no longer inside it
    assert pair.replica["e"] is not pair.replica["d"]["k"]
    await pair.cell("e.append(5)")
    assert pair.replica["d"]["k"] == [1]


async def test_instances_share_their_class_with_its_name(pair: Pair) -> None:
    await pair.cell("class K: pass\nk1 = K()")
    await pair.cell("k2 = K()")
    r = pair.replica
    assert type(r["k1"]) is type(r["k2"]) is r["K"]


async def test_self_referencing_structures(pair: Pair) -> None:
    await pair.cell("loop = []\nloop.append(loop)\nm = {}\nm['me'] = m")
    r = pair.replica
    assert r["loop"][0] is r["loop"] and r["m"]["me"] is r["m"]


async def test_unrelated_names_are_not_resent(pair: Pair) -> None:
    await pair.cell(
        "import numpy as np\nx = np.zeros(3)\ny = np.ones(3)\nt = ('s', 1)\nu = ('s', 1)"
    )
    delta = await pair.cell("x[0] = 1")
    # arrays share a dtype object and tuples share strings: neither ties names together
    assert await sent_names(delta, pair.store) == {"x"}
