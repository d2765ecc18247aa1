"""A real IPython shell as the executor, a separate process as the replica."""

from __future__ import annotations

import json
from pathlib import Path

from tests.kernel.conftest import replay_file_in_child, run_json

EXECUTOR = Path(__file__).with_name("_ipython_executor.py")

CELLS = [
    "import numpy as np\nfrom os import path\nx = 41",
    "def bump(v):\n    return v + 1\n"
    "class Box:\n    def __init__(self, v):\n        self.v = bump(v)",
    "box = Box(x)\nbox.v",  # an expression: IPython fills _, _3, Out
    "items = [box]\nitems.append(np.arange(4))",
    "gen = (i for i in range(3))\ny = 2",
    "del x",
]


def test_ipython_user_namespace_syncs_without_bookkeeping(tmp_path: Path) -> None:
    store, deltas, cells = tmp_path / "blobs", tmp_path / "deltas", tmp_path / "cells.json"
    cells.write_text(json.dumps(CELLS))
    executor = run_json([str(EXECUTOR), str(store), str(deltas), str(cells)])
    assert executor["sent"] == [
        ["x", "np", "path"],
        ["Box", "bump"],
        ["Box", "box"],  # box's class travels with it, so its identity is shared
        ["Box", "box", "items"],  # items holds box: its whole alias group travels
        ["y"],
        [],
    ]
    assert executor["unpicklable"] == ["gen"]
    replica = replay_file_in_child(
        store,
        deltas,
        "result = [box.v, type(items[0]) is Box, bump(1), 'x' in dir(), path.sep]",
        tmp_path,
    )
    assert replica["digest"] == executor["digest"]
    assert replica["probe"] == [42, True, 2, False, "/"]
