"""Property: after any sequence of cells, capture on the executor + apply on a replica
leaves both namespaces with equal digests and the same aliasing between names."""

from __future__ import annotations

import builtins
import os
import tempfile
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nbos.kernel.state import StateCapture, apply, namespace_digest
from nbos.store.local import LocalObjectStore

NAMES = ["a", "b", "c", "d", "e"]
EXAMPLES = int(os.environ.get("NBOS_STATE_EXAMPLES", "60"))

atoms = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.binary(max_size=5),
)
hashables = st.one_of(st.integers(), st.text(max_size=4))
values = st.recursive(
    atoms,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=3), inner, max_size=4),
        st.sets(hashables, max_size=4),
    ),
    max_leaves=12,
)
name = st.sampled_from(NAMES)
operation = st.one_of(
    st.tuples(st.just("assign"), name, values),
    st.tuples(st.just("alias"), name, name),
    st.tuples(st.just("inner"), name, name),
    st.tuples(st.just("append"), name, st.one_of(name, values)),
    st.tuples(st.just("setitem"), name, st.text(max_size=2), st.one_of(name, values)),
    st.tuples(st.just("delete"), name),
    st.tuples(st.just("array"), name, st.integers(0, 64)),
    st.tuples(st.just("poke"), name, st.integers(0, 63), st.floats(allow_nan=False)),
    st.tuples(st.just("view"), name, name),
    st.tuples(st.just("def"), name, atoms),
    st.tuples(st.just("class"), name, atoms),
    st.tuples(st.just("make"), name, name),
)
cells = st.lists(st.lists(operation, min_size=1, max_size=3), min_size=1, max_size=6)


def run(ns: dict[str, Any], op: tuple[Any, ...]) -> None:
    """Apply one operation to the executor namespace, as a cell would."""
    kind, target, *rest = op

    def resolve(x: object) -> object:
        return ns[x] if isinstance(x, str) and x in NAMES and x in ns else x

    if kind == "assign":
        ns[target] = rest[0]
    elif kind == "alias" and rest[0] in ns:
        ns[target] = ns[rest[0]]
    elif kind == "inner" and isinstance(ns.get(rest[0]), list | dict) and ns[rest[0]]:
        src = ns[rest[0]]
        ns[target] = src[0] if isinstance(src, list) else next(iter(src.values()))
    elif kind == "append" and isinstance(ns.get(target), list):
        ns[target].append(resolve(rest[0]))
    elif kind == "setitem" and isinstance(ns.get(target), dict):
        ns[target][rest[0]] = resolve(rest[1])
    elif kind == "delete":
        ns.pop(target, None)
    elif kind == "array":
        ns[target] = np.arange(rest[0], dtype=np.float64)
    elif kind == "poke" and isinstance(ns.get(target), np.ndarray) and ns[target].size:
        ns[target][rest[0] % ns[target].size] = rest[1]
    elif kind == "view" and isinstance(ns.get(rest[0]), np.ndarray):
        ns[target] = ns[rest[0]][1:]  # shares memory with the array it views
    elif kind in ("def", "class"):
        # the atom reaches the cell through a global: not every repr is a literal (inf)
        ns["atom_"] = rest[0]
        if kind == "def":  # a cell-defined function, with a default and a global lookup
            exec(f"def {target}(v=atom_):\n    return (v, {target})", ns)
        else:
            exec(f"class {target}:\n    v = atom_\n    def me(self):\n        return self", ns)
        del ns["atom_"]
    elif kind == "make" and isinstance(ns.get(rest[0]), type):
        ns[target] = ns[rest[0]]()


def aliasing(ns: dict[str, Any]) -> set[tuple[str, str]]:
    """Pairs of names bound to one mutable object (the identity of an int is not state)."""
    present = [
        n
        for n in NAMES
        if isinstance(ns.get(n), list | dict | set | np.ndarray | type)
        or type(ns.get(n)).__module__ == "__main__"
    ]
    return {(x, y) for x in present for y in present if x < y and ns[x] is ns[y]}


def shared_memory(ns: dict[str, Any]) -> set[tuple[str, str]]:
    """Pairs of names whose arrays share memory (an array and its view)."""
    arrays = [n for n in NAMES if isinstance(ns.get(n), np.ndarray)]
    return {(x, y) for x in arrays for y in arrays if x < y and np.shares_memory(ns[x], ns[y])}


@settings(max_examples=EXAMPLES)
@given(cells)
def test_capture_then_apply_keeps_replicas_equal(program: list[list[tuple[Any, ...]]]) -> None:
    async def main(root: Path) -> None:
        store = LocalObjectStore(root)
        # A tiny threshold sends even these small arrays through the blob path.
        capture = StateCapture(store, threshold=64)
        executor: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        replica: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        for index, cell in enumerate(program, start=1):
            for op in cell:
                run(executor, op)
            await apply(replica, await capture.capture(executor, index), store)
            assert namespace_digest(replica) == namespace_digest(executor)
            assert aliasing(replica) == aliasing(executor)
            assert shared_memory(replica) == shared_memory(executor)
            assert set(replica) == set(executor)

    with tempfile.TemporaryDirectory() as root:
        anyio.run(main, Path(root))
