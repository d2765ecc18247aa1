"""A replica in its own process: applies deltas to a fresh namespace, then runs a probe cell.

Usage: ``python _replica_child.py STORE_DIR DELTAS_FILE PROBE_FILE``. DELTAS_FILE holds
msgpack-encoded wire messages, one per list item. Prints one JSON object:
``{"digest": <namespace digest after the deltas>, "probe": <the probe's `result`>,
"after": <digest after the probe>}``. The process never sees the cells' source, so
functions and classes can only come from the deltas.
"""

from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from nbos.core.wire import decode
from nbos.core.wire.state import StateDelta
from nbos.kernel.state import apply, namespace_digest
from nbos.store.local import LocalObjectStore


async def main(store_dir: str, deltas: list[bytes], probe: str) -> None:
    store = LocalObjectStore(Path(store_dir))
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    for raw in deltas:
        delta = decode(raw)
        assert isinstance(delta, StateDelta)
        await apply(namespace, delta, store)
    digest = namespace_digest(namespace)
    exec(compile(probe, "<probe>", "exec"), namespace)
    result = namespace.pop("result", None)
    print(json.dumps({"digest": digest, "probe": result, "after": namespace_digest(namespace)}))


if __name__ == "__main__":
    store_dir, deltas_file, probe_file = sys.argv[1:4]
    deltas = msgspec.msgpack.decode(Path(deltas_file).read_bytes())
    anyio.run(main, store_dir, deltas, Path(probe_file).read_text())
