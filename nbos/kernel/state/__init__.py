"""State capture and apply: a cell's changes to the user namespace, carried to replicas.

On the executor, after each cell::

    delta = await capture.capture(namespace, exec_index)   # a StateDelta log entry
    for name, reason in delta.unpicklable: ...             # tell the user, once

on every other replica, in log order::

    await apply(namespace, delta, store)
    await capture.baseline(namespace)   # before this replica next runs a cell

``namespace_digest`` compares namespaces across processes; ``dump_namespace`` and
``load_namespace`` turn a whole namespace into a snapshot image and back.
``ProcessState`` does the same for what a cell changes outside its namespace (global
random generators, working directory, environment), which rides in the same entries. Values
and images hold pickles: apply only entries from the kernel's own replicas.
"""

from nbos.kernel.state._apply import apply
from nbos.kernel.state._buffers import LARGE
from nbos.kernel.state._capture import StateCapture
from nbos.kernel.state._digest import namespace_digest
from nbos.kernel.state._names import UserState, is_user_name
from nbos.kernel.state._process import ProcessState
from nbos.kernel.state._snapshot import dump_namespace, image_process, load_namespace

__all__ = [
    "LARGE",
    "ProcessState",
    "StateCapture",
    "UserState",
    "apply",
    "dump_namespace",
    "image_process",
    "is_user_name",
    "load_namespace",
    "namespace_digest",
]
