"""The replica's use of :mod:`nbos.kernel.state`: capture, apply, restore, digest.

One narrow seam, so the kernel does not depend on how the state module uploads
large values or lays out its images.
"""

from __future__ import annotations

import hashlib
from collections.abc import MutableMapping
from typing import Any

import msgspec

from nbos.core.object_store import ObjectStore
from nbos.core.wire.state import StateDelta
from nbos.kernel import state


class NamespaceSync:
    """Moves one replica's user namespace to and from the kernel's log.

    Capture is stateful (it remembers what the previous capture sent), so one
    instance lives as long as the replica. After other replicas' cells applied here
    it sends more than strictly changed, never less.
    """

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        self._capture = state.StateCapture(store)
        self._process = state.ProcessState()
        self._nothing: bytes | None = None

    async def capture(self, user_ns: MutableMapping[str, Any], index: int) -> StateDelta:
        """What cell ``index``, which just ran here, changed in ``user_ns`` and in the
        process (its global generators, working directory, environment)."""
        delta = await self._capture.capture(user_ns, index)
        return msgspec.structs.replace(delta, process=self._process.capture())

    async def changes_anything(self, delta: StateDelta) -> bool:
        """Whether ``delta`` changes a namespace at all (an empty one need not be logged)."""
        if self._nothing is None:
            # What a capture sends when no value changed: the encoding of no values.
            self._nothing = (await state.StateCapture(self._store).capture({}, 0)).set
        return bool(
            delta.set != self._nothing
            or delta.set_blob
            or delta.deleted
            or delta.imports
            or delta.unpicklable
            or delta.process
        )

    async def apply(self, user_ns: MutableMapping[str, Any], delta: StateDelta) -> None:
        """Apply another replica's committed delta to ``user_ns``."""
        await state.apply(user_ns, delta, self._store)
        self._process.apply(delta.process)

    async def restore(self, user_ns: MutableMapping[str, Any], image: bytes) -> None:
        """Replace the user state of ``user_ns`` by a snapshot image (empty: none)."""
        # Cell-defined functions must see ``user_ns`` as their globals, builtins included.
        loaded = await state.load_namespace(image, self._store, globals_of=user_ns) if image else {}
        for name in [n for n in user_ns if state.is_user_name(n)]:
            del user_ns[name]
        user_ns.update(loaded)
        self._process.restore(state.image_process(image) if image else {})

    async def baseline(self, user_ns: MutableMapping[str, Any]) -> None:
        """``user_ns`` is what every replica holds now (it was restored): the next
        capture sends what changes from here."""
        await self._capture.baseline(user_ns)

    async def image(self, user_ns: MutableMapping[str, Any]) -> bytes:
        """The user state of ``user_ns`` (and of the process) as a snapshot image."""
        return await self._capture.image(user_ns, process=self._process.image())

    def digest(self, user_ns: MutableMapping[str, Any]) -> str:
        """Canonical digest of the user state and the global generators, equal on
        replicas that applied the same cells."""
        h = hashlib.sha256(state.namespace_digest(user_ns).encode())
        h.update(self._process.digest())
        return h.hexdigest()
