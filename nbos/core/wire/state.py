"""Log entries that carry a cell's changes to the user namespace (design step 6).

The executor captures what a cell changed and commits one :class:`StateDelta`;
every replica applies it in log order. Values travel as one pickle so that
objects shared between names stay shared; buffers of 1 MiB or more travel as
content-addressed blobs in the object store, and the entry holds their keys.
"""

from __future__ import annotations

from nbos.core.ids import BlobKey
from nbos.core.wire.base import Message


class StateDelta(Message):
    """What cell ``exec_index`` changed in the user namespace.

    * ``set``: one pickle (protocol 5) of a ``dict`` from name to new value, or
      empty when the pickle itself is 1 MiB or more and lives in the object
      store under ``set_blob``.
    * ``blobs``: keys of the pickle's out-of-band buffers, in buffer order.
    * ``set_names``: the names ``set`` holds, so that a replica knows before unpickling
      which of its values the delta replaces (their buffers may then be patched in place).
    * ``deleted``: names the cell removed.
    * ``imports``: ``(alias, module)`` pairs; the module is imported by name on
      apply, never pickled.
    * ``unpicklable``: ``(name, reason)`` for values that stay on the executor;
      replicas drop any older value of those names so they hold no stale copy.
    * ``process``: process-wide state the cell changed (global random generators,
      working directory, environment variables), part name to its bytes, ``None``
      for an environment variable unset (see ``nbos.kernel.state._process``).
    """

    exec_index: int
    set: bytes = b""
    set_blob: BlobKey | None = None
    blobs: list[BlobKey] = []
    set_names: list[str] = []
    deleted: list[str] = []
    imports: list[tuple[str, str]] = []
    unpicklable: list[tuple[str, str]] = []
    process: dict[str, bytes | None] = {}


StateEntry = StateDelta
