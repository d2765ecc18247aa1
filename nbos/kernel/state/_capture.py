"""Capturing what a cell changed in the user namespace (the executor's side)."""

from __future__ import annotations

import logging
import pickle
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Literal

from nbos.core.ids import BlobKey
from nbos.core.object_store import ObjectStore
from nbos.core.wire.state import StateDelta
from nbos.kernel.state import _codec, _pages
from nbos.kernel.state._buffers import LARGE, BufferKeys, place_of
from nbos.kernel.state._names import user_items

log = logging.getLogger(__name__)

# How a name's value is recognised as unchanged: (id of the value, content hash of its
# pickle and buffer keys, how it shares objects with other names). A module is
# ("module", its name); a value that cannot be pickled is ("unpicklable", id).
Fingerprint = tuple[object, ...]
_Place = tuple[int, int]


class StateCapture:
    """Computes, after each cell, the :class:`StateDelta` that brings replicas level.

    One instance per executor process; it remembers each name's fingerprint from
    the previous capture. Contract:

    * a name whose value is new, rebound, mutated in place, deleted, or whose sharing
      of objects with other names changed, is in the delta;
    * names that share an object travel together in one pickle, with every other
      name of their alias group, so sharing survives the trip;
    * buffers of ``threshold`` bytes or more are written to ``store`` as blobs; one
      that is unchanged since the last capture is neither hashed (where the kernel
      keeps soft-dirty page bits, see :mod:`._pages`) nor written again;
    * a value that cannot be pickled is reported once per value in
      ``delta.unpicklable`` and stays on the executor; other names still sync.

    ``page_tracking``: ``"auto"`` uses soft-dirty bits when the kernel has them,
    ``"off"`` always hashes large buffers.
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        threshold: int = LARGE,
        page_tracking: Literal["auto", "off"] = "auto",
    ) -> None:
        self._store = store
        self._threshold = threshold
        pages = _pages.probe() if page_tracking == "auto" else None
        self._keys = BufferKeys(pages)
        # Strong references to the values fingerprinted, so their ids cannot be reused.
        self._values: dict[str, object] = {}
        self._fingerprints: dict[str, Fingerprint] = {}

    @property
    def hashed_bytes(self) -> int:
        """Bytes of large buffers the last capture had to hash (0 when all were known)."""
        return self._keys.hashed_bytes

    async def capture(self, namespace: Mapping[str, object], exec_index: int = 0) -> StateDelta:
        """What changed in ``namespace`` since the previous call, as a log entry."""
        current = dict(user_items(namespace))
        modules: dict[str, str] = {}
        pickled: dict[str, _codec.Pickled] = {}
        failed: dict[str, str] = {}
        for name, value in current.items():
            if isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value:
                modules[name] = value.__name__
                continue
            try:
                pickled[name] = _codec.pickle_value(value, self._threshold)
            except Exception as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
        keys = await self._buffer_keys(pickled.values())
        groups, sharing = _alias_groups(pickled)
        fingerprints: dict[str, Fingerprint] = {}
        for name, module in modules.items():
            fingerprints[name] = ("module", module)
        for name in failed:
            fingerprints[name] = ("unpicklable", id(current[name]))
        for name, p in pickled.items():
            content = _codec.content_hash(p, [keys[place_of(b)] for b in p.buffers])
            fingerprints[name] = (id(current[name]), content, sharing[name])
        changed = [n for n in current if self._fingerprints.get(n) != fingerprints[n]]
        send = {member for n in changed if n in pickled for member in groups[n]}
        encoded = _codec.Encoded(b"", None, [])
        if send:
            values = {n: current[n] for n in current if n in send}
            loadable, unloadable = _codec.pickle_loadable(values, self._threshold)
            for name, reason in unloadable.items():
                failed[name] = reason
                fingerprints[name] = ("unpicklable", id(current[name]))
            if len(unloadable) < len(values):
                encoded = await _codec.encode(loadable, self._store, keys, self._threshold)
        delta = StateDelta(
            exec_index=exec_index,
            set=encoded.inline,
            set_blob=encoded.blob,
            blobs=encoded.buffers,
            deleted=[n for n in self._fingerprints if n not in current],
            imports=[(n, modules[n]) for n in changed if n in modules],
            unpicklable=[
                (n, failed[n])
                for n in current
                if n in failed and self._fingerprints.get(n) != fingerprints[n]
            ],
        )
        for name, reason in delta.unpicklable:
            log.info("%s stays on the executor: %s", name, reason)
        self._values, self._fingerprints = current, fingerprints
        return delta

    async def _buffer_keys(self, pickles: Iterable[_codec.Pickled]) -> dict[_Place, BlobKey]:
        buffers: list[pickle.PickleBuffer] = []
        owners: dict[int, object] = {}
        for p in pickles:
            buffers.extend(p.buffers)
            owners.update(p.owners)
        return await self._keys.keys(buffers, owners)


def _alias_groups(
    pickled: Mapping[str, _codec.Pickled],
) -> tuple[dict[str, frozenset[str]], dict[str, tuple[tuple[int, str, int], ...]]]:
    """Names that share an object, and for each name how it shares.

    A name's sharing is, for each shared object, its memo index in this name's pickle
    and the first ``(name, index)`` holding it: it changes when sharing starts, stops
    or moves, even if neither name's pickle bytes change.
    """
    first: dict[int, tuple[str, int]] = {}
    parent = {name: name for name in pickled}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    sharing: dict[str, list[tuple[int, str, int]]] = {name: [] for name in pickled}
    for name, p in pickled.items():
        for ident, index in p.identities.items():
            owner = first.setdefault(ident, (name, index))
            if owner[0] != name:
                sharing[name].append((index, *owner))
                sharing[owner[0]].append((owner[1], *owner))
                parent[root(name)] = root(owner[0])
    members: dict[str, set[str]] = {}
    for name in pickled:
        members.setdefault(root(name), set()).add(name)
    groups = {name: frozenset(members[root(name)]) for name in pickled}
    return groups, {name: tuple(sorted(set(s))) for name, s in sharing.items()}
