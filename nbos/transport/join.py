"""A cluster's join token: how an agent with a key pair of its own joins a gateway.

As ``docker swarm join`` does with its tokens: ``nbos keys DIR --join-token`` writes
``DIR/join.token`` (mode ``0600``), one line::

    NBOSJ1-<the gateway's CURVE public key, Z85, 40 characters>-<secret, 64 hex digits>

An agent given the token makes its own CURVE key pair on first start (kept in its state
directory, :func:`agent_key_pair`), connects to the gateway's join endpoint as a CURVE
client of the public key in the token (so it talks to that gateway or to no one), and
sends :class:`~nbos.core.wire.agent.AgentJoin`: its host name, its public key, a fresh
nonce, the time, and :func:`join_proof`, an HMAC-SHA256 keyed with the secret over all
of them and the gateway's key. The secret itself never goes on the wire. The gateway
checks the proof (:class:`JoinVerifier`: a proof older than :data:`JOIN_WINDOW_S`, or
one it has seen, is refused) and pins the host's key (``DIR/hosts/NAME.key``, as
``nbos keys`` would have written it): from then on it admits that host with that key
only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from pathlib import Path

import attrs
import zmq
import zmq.auth
import zmq.utils.z85

from nbos.core.errors import ConfigError
from nbos.core.wire.agent import JoinRefusalKind
from nbos.transport.keys import GATEWAY_KEY, HOSTS_DIR, check_host_name, generate_keys

TOKEN_FILE = "join.token"
_PREFIX = "NBOSJ1"
_TOKEN = re.compile(rf"{_PREFIX}-(?P<public>.{{40}})-(?P<secret>[0-9a-f]{{64}})")
_PROOF_CONTEXT = b"nbos-join-v1"
#: How old (or how far ahead of the gateway's clock) a join's time may be.
JOIN_WINDOW_S = 300.0
_AGENT_KEY = "agent"


@attrs.frozen(repr=False)
class JoinToken:
    """A parsed join token; ``repr`` leaves the secret out (it ends up in logs)."""

    gateway_public: bytes
    secret: bytes

    def __repr__(self) -> str:
        return f"JoinToken(gateway_public={self.gateway_public!r}, secret=...)"

    @classmethod
    def parse(cls, text: str, source: str = "join token") -> JoinToken:
        """The token in ``text`` (surrounding white space ignored), or :class:`ConfigError`."""
        match = _TOKEN.fullmatch(text.strip())
        if match is None:
            raise ConfigError(source, "<not shown>", f"{_PREFIX}-<40-char Z85 key>-<64 hex>")
        public = match["public"].encode()
        try:
            zmq.utils.z85.decode(public)
        except ValueError as exc:
            raise ConfigError(source, "<not shown>", f"a Z85 gateway key ({exc})") from exc
        return cls(public, bytes.fromhex(match["secret"]))

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> JoinToken:
        """The token in file ``path``; :class:`ConfigError` when it cannot be read or parsed."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError("join_token_file", str(path), f"a readable file ({exc})") from exc
        return cls.parse(text, f"join_token_file {path}")

    def text(self) -> str:
        return f"{_PREFIX}-{self.gateway_public.decode()}-{self.secret.hex()}"


def make_join_token(directory: str | os.PathLike[str]) -> tuple[Path, bool]:
    """``DIR/join.token`` for the gateway's key pair in ``directory`` (made if missing);
    returns its path and whether it is new. An existing token is kept: agents that hold it
    keep joining."""
    root = Path(directory)
    generate_keys(root, [])
    path = root / TOKEN_FILE
    if path.exists():
        JoinToken.read(path)  # a damaged one is refused, not silently replaced
        return path, False
    public, _ = zmq.auth.load_certificate(root / f"{GATEWAY_KEY}.key")
    token = JoinToken(public, secrets.token_bytes(32))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token.text() + "\n")
    return path, True


def join_proof(token: JoinToken, host: str, public_key: str, nonce: str, timestamp: float) -> str:
    """The HMAC (hex) with which an agent proves it holds ``token``'s secret."""
    message = b"\0".join(
        [
            _PROOF_CONTEXT,
            token.gateway_public,
            host.encode(),
            public_key.encode(),
            nonce.encode(),
            repr(float(timestamp)).encode(),
        ]
    )
    return hmac.new(token.secret, message, hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(16)


class JoinVerifier:
    """Checks joins against one token; remembers the nonces of its window (replays)."""

    def __init__(self, token: JoinToken, window_s: float = JOIN_WINDOW_S) -> None:
        self._token = token
        self._window = window_s
        self._seen: dict[str, float] = {}

    def check(
        self, host: str, public_key: str, nonce: str, timestamp: float, proof: str
    ) -> JoinRefusalKind | None:
        """Why the join is refused (``bad_proof``, ``expired``, ``replayed``), or ``None``."""
        expected = join_proof(self._token, host, public_key, nonce, timestamp)
        if not hmac.compare_digest(expected, proof):
            return "bad_proof"
        now = time.time()
        if abs(now - timestamp) > self._window:
            return "expired"
        self._seen = {n: t for n, t in self._seen.items() if now - t <= self._window}
        if nonce in self._seen:
            return "replayed"
        self._seen[nonce] = now
        return None


def pin_host_key(directory: str | os.PathLike[str], host: str, public_key: bytes) -> bool:
    """Pin ``host``'s public key in ``DIR/hosts/NAME.key``; returns whether it is new.

    Raises :class:`ConfigError` (key ``host``) when another key is pinned for it: the
    operator forgets a host by deleting that file.
    """
    path = Path(directory) / HOSTS_DIR / f"{check_host_name(host)}.key"
    if path.exists():
        pinned, _ = zmq.auth.load_certificate(path)
        if pinned != public_key:
            raise ConfigError("host", host, f"its key pinned in {path} (delete it to forget)")
        return False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        # The layout zmq.auth writes and reads (a public certificate of nbos keys).
        out.write("#   pinned by nbos join\nmetadata\ncurve\n")
        out.write(f'    public-key = "{public_key.decode()}"\n')
    os.replace(scratch, path)
    return True


def agent_key_pair(state_dir: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """This agent's own CURVE pair (public, secret), in ``STATE/keys`` (made on first use)."""
    directory = Path(state_dir) / "keys"
    secret_file = directory / f"{_AGENT_KEY}.key_secret"
    if not secret_file.exists():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        # Made in the same directory and renamed, as nbos keys does: never a readable secret.
        scratch = directory / f".new-{secrets.token_hex(4)}"
        scratch.mkdir(mode=0o700)
        try:
            public, secret = zmq.auth.create_certificates(scratch, _AGENT_KEY)
            for made in (public, secret):
                os.chmod(made, 0o600)
            os.replace(public, directory / f"{_AGENT_KEY}.key")
            os.replace(secret, secret_file)
        finally:
            for left in scratch.iterdir():
                left.unlink()
            scratch.rmdir()
    try:
        public_key, secret_key = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as exc:
        raise ConfigError("state_dir", str(secret_file), f"the agent's key pair ({exc})") from exc
    if secret_key is None:
        raise ConfigError("state_dir", str(secret_file), "the agent's key pair")
    return public_key, secret_key


def default_join_address(agent_address: str) -> str:
    """The gateway's join endpoint by default: the agent endpoint's host, its port + 1."""
    host, _, port = agent_address.removeprefix("tcp://").rpartition(":")
    if not port.isdigit() or int(port) in (0, 65535):
        raise ConfigError("join_address", agent_address, "HOST:PORT (a fixed agent port, or this)")
    return f"tcp://{host}:{int(port) + 1}"
