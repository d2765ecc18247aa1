"""Capturing what a cell changed in the user namespace (the executor's side)."""

from __future__ import annotations

import logging
import pickle
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from nbos.core.ids import BlobKey
from nbos.core.object_store import ObjectStore
from nbos.core.wire.state import StateDelta
from nbos.kernel.state import _codec, _pages
from nbos.kernel.state._buffers import LARGE, BufferKeys, place_of
from nbos.kernel.state._names import user_items
from nbos.kernel.state._snapshot import dump_namespace

log = logging.getLogger(__name__)

# How a name's value is recognised as unchanged: (id of the value, content hash of its
# pickle and buffer keys, how it shares objects with other names). A module is
# ("module", its name); a value that cannot be pickled is ("unpicklable", id).
Fingerprint = tuple[object, ...]
_Place = tuple[int, int]


class StateCapture:
    """Computes, after each cell, the :class:`StateDelta` that brings replicas level.

    One instance per replica process, living as long as the replica; it remembers
    each name's fingerprint from the previous capture (or :meth:`baseline`).
    Captures must not run concurrently. Contract:

    * a name whose value is new, rebound, mutated in place, deleted, or whose sharing
      of objects with other names changed, is in the delta;
    * names that share an object travel together in one pickle, with every other
      name of their alias group, so sharing survives the trip;
    * buffers of ``threshold`` bytes or more are written to ``store`` as blobs; one
      that is unchanged since the last capture is neither hashed (where the kernel
      tracks page writes, see :mod:`._pages`) nor written again, and one that changed
      is read once, hashed as it is written;
    * a value that cannot be pickled, or whose pickle does not load back, is reported
      once per value in ``delta.unpicklable`` and stays on the executor; other names
      still sync;
    * a failing store raises :class:`~nbos.core.errors.StoreError` and nothing is
      remembered, so the next capture sends the same changes again.

    Cost per capture: every user value is pickled (buffers of ``threshold`` bytes or
    more by reference, not copied) and hashed with BLAKE2b; large buffers cost a
    page-bit read (about 2 ms per GB with soft-dirty bits, microseconds with
    userfaultfd) or, without page tracking, a SHA-256 pass.

    ``page_tracking``: ``"auto"`` uses soft-dirty bits when the kernel has them, else
    write-protect userfaultfd when it allows it; ``"off"`` always hashes large buffers.
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
        scan = await self._scan(namespace, self._store)
        changed = [n for n in scan.current if self._fingerprints.get(n) != scan.fingerprints[n]]
        send = {member for n in changed if n in scan.pickled for member in scan.groups[n]}
        encoded = await self._encode(scan, send)
        delta = StateDelta(
            exec_index=exec_index,
            set=encoded.inline,
            set_blob=encoded.blob,
            blobs=encoded.buffers,
            set_names=sorted(n for n in send if n not in scan.failed),
            deleted=[n for n in self._fingerprints if n not in scan.current],
            imports=[(n, scan.modules[n]) for n in changed if n in scan.modules],
            unpicklable=[
                (n, reason)
                for n, reason in scan.failed.items()
                if self._fingerprints.get(n) != scan.fingerprints[n]
            ],
        )
        for name, reason in delta.unpicklable:
            log.info("%s stays on the executor: %s", name, reason)
        self._values, self._fingerprints = scan.current, scan.fingerprints
        return delta

    async def baseline(self, namespace: Mapping[str, object]) -> None:
        """Take ``namespace`` as what every replica holds now, without making a delta.

        For a replica that applied other replicas' deltas (or a snapshot) since its
        own last capture: without it, its next capture resends what it applied.
        """
        scan = await self._scan(namespace, None)
        self._values, self._fingerprints = scan.current, scan.fingerprints

    async def image(
        self, namespace: Mapping[str, object], *, process: Mapping[str, bytes | None] | None = None
    ) -> bytes:
        """``namespace`` as a snapshot image (:func:`dump_namespace`), its large buffers
        referred to as they are stored already where this capture knows them unchanged."""
        return await dump_namespace(
            namespace, self._store, threshold=self._threshold, process=process, keys=self._keys
        )

    async def _scan(self, namespace: Mapping[str, object], store: ObjectStore | None) -> _Scan:
        """Fingerprint ``namespace``; large buffers that must be hashed go to ``store`` on
        the way when given (a capture sends what changed, so it writes them anyway)."""
        scan = _Scan(current=dict(user_items(namespace)))
        for name, value in scan.current.items():
            if isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value:
                scan.modules[name] = value.__name__
                scan.fingerprints[name] = ("module", value.__name__)
                continue
            try:
                scan.pickled[name] = _codec.pickle_value(value, self._threshold)
            except Exception as exc:
                scan.fail(name, f"{type(exc).__name__}: {exc}")
        scan.keys = await self._buffer_keys(scan.pickled.values(), store)
        scan.groups, sharing = _alias_groups(scan.pickled)
        for name, p in scan.pickled.items():
            content = _codec.content_hash(p, [scan.keys[place_of(b)] for b in p.buffers])
            scan.fingerprints[name] = (id(scan.current[name]), content, sharing[name])
        return scan

    async def _encode(self, scan: _Scan, send: set[str]) -> _codec.Encoded:
        """One pickle of the names in ``send``; names whose pickle does not load go to failed."""
        if not send:
            return _codec.Encoded(b"", None, [])
        values = {n: v for n, v in scan.current.items() if n in send}
        loadable, unloadable = _codec.pickle_loadable(values, self._threshold)
        for name, reason in unloadable.items():
            scan.fail(name, reason)
        if len(unloadable) == len(values):
            return _codec.Encoded(b"", None, [])
        return await _codec.encode(loadable, self._store, scan.keys, self._threshold)

    async def _buffer_keys(
        self, pickles: Iterable[_codec.Pickled], store: ObjectStore | None
    ) -> dict[_Place, BlobKey]:
        buffers: list[pickle.PickleBuffer] = []
        owners: dict[int, object] = {}
        for p in pickles:
            buffers.extend(p.buffers)
            owners.update(p.owners)
        return await self._keys.keys(buffers, owners, store)


@dataclass
class _Scan:
    """One look at a namespace: each name's value, pickle or failure, and fingerprint."""

    current: dict[str, object]
    modules: dict[str, str] = field(default_factory=dict)
    pickled: dict[str, _codec.Pickled] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    keys: dict[_Place, BlobKey] = field(default_factory=dict)
    groups: dict[str, frozenset[str]] = field(default_factory=dict)
    fingerprints: dict[str, Fingerprint] = field(default_factory=dict)

    def fail(self, name: str, reason: str) -> None:
        self.failed[name] = reason
        self.fingerprints[name] = ("unpicklable", id(self.current[name]))


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
