"""An executor in its own process: runs cells in a real IPython shell, captures after each.

Usage: ``python _ipython_executor.py STORE_DIR DELTAS_FILE CELLS_FILE``. CELLS_FILE is a
JSON list of cell sources. Writes the encoded deltas to DELTAS_FILE and prints one JSON
object: ``{"digest": ..., "sent": [names per cell], "unpicklable": [...]}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import msgspec
from IPython.core.interactiveshell import InteractiveShell

from nbos.core.wire import encode
from nbos.kernel.state import StateCapture, _codec, namespace_digest
from nbos.store.local import LocalObjectStore


async def main(store_dir: str, cells: list[str]) -> tuple[list[bytes], dict[str, object]]:
    store = LocalObjectStore(Path(store_dir))
    shell = InteractiveShell.instance()
    capture = StateCapture(store)
    deltas: list[bytes] = []
    sent: list[list[str]] = []
    unpicklable: list[str] = []
    for index, cell in enumerate(cells, start=1):
        result = shell.run_cell(cell, store_history=True)  # type: ignore[no-untyped-call]
        assert result.success, result.error_in_exec
        delta = await capture.capture(shell.user_ns, index)
        deltas.append(encode(delta))
        encoded = _codec.Encoded(delta.set, delta.set_blob, delta.blobs)
        values = await _codec.decode(encoded, {}, store) if delta.set or delta.set_blob else {}
        sent.append(sorted(values) + [alias for alias, _ in delta.imports])
        unpicklable += [name for name, _ in delta.unpicklable]
    report: dict[str, object] = {
        "digest": namespace_digest(shell.user_ns),
        "sent": sent,
        "unpicklable": unpicklable,
    }
    return deltas, report


if __name__ == "__main__":
    store_dir, deltas_file, cells_file = sys.argv[1:4]
    deltas, report = anyio.run(main, store_dir, json.loads(Path(cells_file).read_text()))
    Path(deltas_file).write_bytes(msgspec.msgpack.encode(deltas))
    print(json.dumps(report))
