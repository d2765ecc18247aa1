"""Process-wide state a cell changes outside its namespace, carried with the cell's delta.

A cell that seeds or draws from a global generator changes state no namespace holds;
without it, the next draw after a failover differs from the one the dead executor
would have made. Each part is read as bytes after every cell and sent only when its
bytes changed since this replica last sent or applied it:

* ``random``: the global generator of the ``random`` module;
* ``numpy.random``: numpy's legacy global ``RandomState`` (``np.random.seed``,
  ``np.random.rand`` ...), once a cell's process imported ``numpy.random``;
* ``torch``: torch's default CPU generator; ``torch.cuda``: the default generator of
  each CUDA device, once CUDA is initialised;
* ``cwd``: the working directory;
* ``env:NAME``: each environment variable a cell set (``None``: unset).

numpy and torch are read only when already imported; they are imported on apply only
when the executor had them. The generators (not ``torch.cuda``, which depends on the
host's devices) are part of the kernel's digest; ``cwd`` and the environment are not,
as hosts may differ in them by design (only a cell's changes travel). The states are
pickles of the kernel's own replicas, like the namespace values.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import pickle
import sys
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

#: What travels: part name to its bytes, or ``None`` for an environment variable unset.
Parts = dict[str, bytes | None]

_ENV = "env:"
T = TypeVar("T")


class _LastRead(Generic[T]):
    """What a part read as last time, and what it looked like raw then.

    Every cell reads every part, and most cells change none: comparing the raw state
    with the last one costs less than encoding it again. ``None`` raw (nothing cheap to
    compare) always reads anew.
    """

    def __init__(self) -> None:
        self._raw: object = None
        self._value: T | None = None

    def get(self, raw: object, read: Callable[[], T]) -> T:
        if raw is None or self._value is None or raw != self._raw:
            self._raw, self._value = raw, read()
        return self._value


_random_read: _LastRead[bytes] = _LastRead()
_environment_read: _LastRead[Parts] = _LastRead()


def _read_random() -> bytes | None:
    module = sys.modules.get("random")
    if module is None:
        return None
    state = module.getstate()
    return _random_read.get(state, lambda: pickle.dumps(state))


def _write_random(data: bytes) -> None:
    importlib.import_module("random").setstate(pickle.loads(data))


def _read_numpy() -> bytes | None:
    module = sys.modules.get("numpy.random")
    return None if module is None else pickle.dumps(module.get_state(legacy=True))


def _write_numpy(data: bytes) -> None:
    importlib.import_module("numpy.random").set_state(pickle.loads(data))


def _read_torch() -> bytes | None:
    torch = sys.modules.get("torch")
    return None if torch is None else bytes(torch.random.get_rng_state().numpy().tobytes())


def _write_torch(data: bytes) -> None:
    torch = importlib.import_module("torch")
    torch.random.set_rng_state(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _read_cuda() -> bytes | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return pickle.dumps([bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()])


def _write_cuda(data: bytes) -> None:
    torch = importlib.import_module("torch")
    if not torch.cuda.is_available():
        log.info("the executor's CUDA generators are not restored: no CUDA device here")
        return
    states = pickle.loads(data)
    for device, state in enumerate(states[: torch.cuda.device_count()]):
        tensor = torch.frombuffer(bytearray(state), dtype=torch.uint8)
        torch.cuda.set_rng_state(tensor, device=device)


def _read_cwd() -> bytes | None:
    try:
        return os.fsencode(os.getcwd())
    except OSError:  # the directory was removed under us
        return None


def _write_cwd(data: bytes) -> None:
    os.chdir(os.fsdecode(data))


_GENERATORS: dict[str, tuple[Callable[[], bytes | None], Callable[[bytes], None]]] = {
    "random": (_read_random, _write_random),
    "numpy.random": (_read_numpy, _write_numpy),
    "torch": (_read_torch, _write_torch),
}
_PARTS = {**_GENERATORS, "torch.cuda": (_read_cuda, _write_cuda), "cwd": (_read_cwd, _write_cwd)}


def _environment() -> Parts:
    # CPython's os.environ keeps the process's bytes in ``_data``: a copy of it costs a
    # fraction of a microsecond, decoding every name and value tens of them.
    raw = getattr(os.environ, "_data", None)
    parts = _environment_read.get(
        dict(raw) if isinstance(raw, dict) else None,
        lambda: {_ENV + k: os.fsencode(v) for k, v in os.environ.items()},
    )
    return dict(parts)  # the caller's to change


class ProcessState:
    """Reads, applies and digests one replica's process-wide state (see the module doc).

    One instance per replica process, living as long as it. It remembers each part's
    bytes as last captured or applied here: only parts whose bytes differ travel. The
    working directory and environment start from this process's own, so that only a
    cell's changes travel; the generators start unknown, so a replica's first capture
    sends them all.
    """

    def __init__(self) -> None:
        #: The working directory and environment this process started with.
        self._initial: Parts = {**_environment(), "cwd": _read_cwd()}
        self._known: Parts = dict(self._initial)

    def current(self) -> Parts:
        """Every part as it is now (a generator of a module not imported is absent)."""
        parts: Parts = {}
        for name, (read, _) in _PARTS.items():
            data = read()
            if data is not None:
                parts[name] = data
        env = _environment()
        gone = [n for n in self._known if n.startswith(_ENV) and n not in env]
        return {**parts, **env, **dict.fromkeys(gone)}

    def capture(self) -> Parts:
        """The parts that changed since the last capture or apply here."""
        known = self._known
        changed = {n: v for n, v in self.current().items() if n not in known or known[n] != v}
        self._known.update(changed)
        return changed

    def image(self) -> Parts:
        """What a snapshot keeps: the generators, and the working directory and
        environment variables as far as cells changed them (not this host's own)."""
        return {
            name: data
            for name, data in self.current().items()
            if name not in self._initial or self._initial[name] != data
        }

    def restore(self, parts: Mapping[str, bytes | None]) -> None:
        """Make the process hold a snapshot's ``parts`` (from :meth:`image`); what they
        lack is as it was at start (the generators: unknown again)."""
        changed = self.image()
        back = {n: self._initial.get(n) for n in changed if n not in parts and n in self._initial}
        unset = {n: None for n in changed if n.startswith(_ENV) and n not in self._initial}
        self.apply({**unset, **back, **parts})
        for name in _PARTS.keys() - parts.keys() - {"cwd"}:
            self._known.pop(name, None)

    def apply(self, parts: Mapping[str, bytes | None]) -> None:
        """Make this process hold the executor's ``parts``; a part that cannot be applied
        here (a module missing on this host, a directory that does not exist) is logged
        and left as it is."""
        for name, data in parts.items():
            try:
                self._apply_one(name, data)
            except Exception as exc:
                log.warning("process state %s not applied: %s: %s", name, type(exc).__name__, exc)
                continue
            self._known[name] = data

    def digest(self) -> bytes:
        """A digest of the generators every replica holds alike once they synced.

        Only generators that travelled (captured or applied here) count: each process
        seeds its own from entropy on import, and a module one replica imported for
        its own reasons is no state of the kernel's.
        """
        h = hashlib.sha256()
        for name, (read, _) in sorted(_GENERATORS.items()):
            data = read() if name in self._known else None
            if data is not None:
                h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        return h.digest()

    @staticmethod
    def _apply_one(name: str, data: bytes | None) -> None:
        if name.startswith(_ENV):
            key = name.removeprefix(_ENV)
            if data is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = os.fsdecode(data)
        elif name in _PARTS and data is not None:
            _PARTS[name][1](data)
        else:
            raise ValueError(f"unknown part {name!r}")
