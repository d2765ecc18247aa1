"""A cluster's CURVE keys on disk: one key pair for the gateway and one per host.

Layout of a key directory (ZeroMQ certificate files, as :mod:`zmq.auth` writes
and reads them; every file mode ``0600``, directories ``0700``)::

    DIR/gateway.key            the gateway's public key
    DIR/gateway.key_secret     the gateway's key pair
    DIR/hosts/NAME.key         host NAME's public key
    DIR/hosts/NAME.key_secret  host NAME's key pair

The whole directory stays on the machine that made it. The gateway needs
``gateway.key_secret`` and every ``hosts/*.key``; the agent of host NAME needs
``hosts/NAME.key_secret`` and ``gateway.key``, in the same layout (see
``docs/deploy.md``). :class:`KeyDirectory` reads either subset.

A kernel's replicas have a key pair of their own, made by the gateway when it
starts the kernel (:func:`kernel_keys_env`), never on disk but in the gateway's
state file: every replica of the kernel holds the same pair and admits only it
(the cluster key model of :class:`~nbos.transport.CurveKeys`) on its Raft port,
which also carries forwarded proposals. It reaches a replica in its environment (through the
agent link, itself CURVE), never on a command line, and the replica takes it out
of its environment at start (:func:`take_kernel_keys`), so that neither cells nor
their subprocesses see it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, MutableMapping
from pathlib import Path

import zmq.auth

from nbos.core.errors import ConfigError, TransportError
from nbos.transport.zmq import CurveKeys

log = logging.getLogger(__name__)

GATEWAY_KEY = "gateway"
HOSTS_DIR = "hosts"
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
#: The environment variables that hand a replica its kernel's key pair (Z85).
KERNEL_SECRET_ENV = "NBOS_KERNEL_CURVE_SECRET"
KERNEL_PUBLIC_ENV = "NBOS_KERNEL_CURVE_PUBLIC"


def check_host_name(name: str) -> str:
    """``name`` if it can name a host (and its key file), else :class:`ConfigError`."""
    if not _HOST_NAME.fullmatch(name):
        raise ConfigError("host", name, "letters, digits, '_', '.', '-' (at most 63), not '.'-led")
    return name


def generate_keys(directory: str | os.PathLike[str], hosts: Iterable[str]) -> list[Path]:
    """Make the gateway's key pair and one per host in ``directory``; returns the new files.

    Key pairs that exist already are kept (so adding a host to a cluster is one more
    call with its name); only missing ones are made. Each pair is written in a
    private temporary directory first and moved into place, so a secret key is
    never readable by others, even for a moment.
    """
    root = Path(directory)
    names = [check_host_name(h) for h in hosts]
    _private_dir(root)
    _private_dir(root / HOSTS_DIR)
    made = _make_pair(root, GATEWAY_KEY)
    for name in names:
        made += _make_pair(root / HOSTS_DIR, name)
    log.info("made %d key files in %s", len(made), root)
    return made


def _private_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("keys", str(path), f"a directory we can create ({exc})") from exc


def _make_pair(directory: Path, name: str) -> list[Path]:
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if secret.exists():
        return []
    with tempfile.TemporaryDirectory(dir=directory, prefix=".new-") as scratch:
        made = zmq.auth.create_certificates(scratch, name)
        for path in made:
            os.chmod(path, 0o600)
        # Secret last: a pair counts as made once its secret file exists.
        shutil.move(os.path.join(scratch, public.name), public)
        shutil.move(os.path.join(scratch, secret.name), secret)
    return [public, secret]


class KeyDirectory:
    """Reads the keys of one cluster from a directory in the layout above."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory)

    def gateway_public(self) -> bytes:
        return _public(self.path / f"{GATEWAY_KEY}.key")

    def host_public(self, host: str) -> bytes:
        return _public(self.path / HOSTS_DIR / f"{check_host_name(host)}.key")

    def hosts(self) -> list[str]:
        """Host names that have a public key here, sorted."""
        return sorted(p.stem for p in (self.path / HOSTS_DIR).glob("*.key"))

    def gateway_curve(self) -> CurveKeys:
        """The gateway's keys, admitting every host with a public key here."""
        public, secret = _pair(self.path / f"{GATEWAY_KEY}.key_secret")
        return CurveKeys(secret, public, frozenset(self.host_public(h) for h in self.hosts()))

    def host_curve(self, host: str) -> CurveKeys:
        """Host ``host``'s keys, admitting only the gateway."""
        public, secret = _pair(self.path / HOSTS_DIR / f"{check_host_name(host)}.key_secret")
        return CurveKeys(secret, public, frozenset({self.gateway_public()}))


def _public(path: Path) -> bytes:
    return _load(path)[0]


def _pair(path: Path) -> tuple[bytes, bytes]:
    public, secret = _load(path)
    if secret is None:
        raise ConfigError("keys", str(path), "a key pair file (NAME.key_secret)")
    return public, secret


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("keys", str(path), f"a readable ZeroMQ certificate ({exc})") from exc


def kernel_keys_env() -> dict[str, str]:
    """A new key pair for one kernel's replicas, as the environment that hands it to them."""
    public, secret = zmq.curve_keypair()
    return {KERNEL_PUBLIC_ENV: public.decode(), KERNEL_SECRET_ENV: secret.decode()}


def take_kernel_keys(environ: MutableMapping[str, str]) -> CurveKeys | None:
    """The kernel's keys from ``environ`` (removed from it); ``None`` when it holds none.

    Raises :class:`ConfigError` when only one of the pair is there or a key is malformed.
    """
    secret, public = environ.pop(KERNEL_SECRET_ENV, ""), environ.pop(KERNEL_PUBLIC_ENV, "")
    if not secret and not public:
        return None
    try:
        keys = CurveKeys(secret.encode(), public.encode())
        matched = zmq.curve_public(keys.secret_key) == keys.public_key
    except (TransportError, ValueError, zmq.ZMQError) as exc:
        raise ConfigError(KERNEL_SECRET_ENV, None, f"the kernel's CURVE key pair ({exc})") from exc
    if not matched:
        raise ConfigError(KERNEL_PUBLIC_ENV, None, f"the public key of {KERNEL_SECRET_ENV}")
    return keys
