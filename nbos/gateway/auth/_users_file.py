"""The users file: the users of a gateway, each with a token hash, a role and a quota.

``[auth] users_file`` names a TOML file (``nbos users add`` writes it)::

    [users.alice]
    token_hash = "sha256:9f86d0..."   # nbos.core.identity.hash_token(token)
    role = "user"                     # or "admin"
    quota = 1                         # guaranteed GPUs; [auth] default_quota if left out

It is read at the gateway's start and again whenever it changes (its modification time),
so adding or removing a user needs no restart. A file that does not decode, an entry
with an unknown key, a hash that is not ``sha256:`` and 64 hex digits, or a hash two
users share is refused with a :class:`~nbos.core.errors.ConfigError` at the start; a
later change that is refused is logged and the users read before stay in force.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from nbos.core.config import convert_strictly, read_toml
from nbos.core.errors import ConfigError
from nbos.core.identity import HASH_SCHEME, Quota, Role, User, UserName, hash_token

log = logging.getLogger(__name__)

_HASH = re.compile(re.escape(HASH_SCHEME) + "[0-9a-f]{64}")
#: How stale the quotas the scheduler reads may be (seconds).
_QUOTAS_CHECK_S = 1.0
#: The name of the gateway's own operator token's user: no file may use it.
RESERVED_NAME = "operator"


class _Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    token_hash: Annotated[str, msgspec.Meta(max_length=128)]
    role: Role = "user"
    quota: Quota | None = None


class _File(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    users: dict[UserName, dict[str, Any]] = msgspec.field(default_factory=dict)


class UsersFile:
    """The users of ``path``, an :class:`~nbos.core.identity.IdentityProvider`."""

    def __init__(self, path: Path, default_quota: int = 0) -> None:
        self.path = path
        self.default_quota = default_quota
        self._by_hash: dict[str, User] = {}
        self._stamp: tuple[int, int] | None = None
        self._reload(strict=True)

    @property
    def users(self) -> tuple[User, ...]:
        self._reload(strict=False)
        return tuple(self._by_hash.values())

    @property
    def quotas(self) -> Mapping[str, int]:
        """Each user's quota, a live view: a change of the file shows in it within a
        second."""
        return _Quotas(self)

    async def authenticate(self, token: str) -> User | None:
        self._reload(strict=False)
        return self._by_hash.get(hash_token(token))

    def _reload(self, *, strict: bool) -> None:
        try:
            stat = self.path.stat()
        except OSError as exc:
            if strict:
                raise ConfigError(
                    "auth.users_file", str(self.path), f"a readable file ({exc.strerror})"
                ) from None
            log.warning("users file %s unreadable, the users read before stay: %s", self.path, exc)
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        try:
            self._by_hash = self._read()
        except ConfigError as exc:
            if strict:
                raise
            log.warning("users file %s refused, the users read before stay: %s", self.path, exc)
        else:
            log.info("users file %s: %d users", self.path, len(self._by_hash))
        self._stamp = stamp

    def _read(self) -> dict[str, User]:
        raw = convert_strictly(read_toml(self.path), _File)
        by_hash: dict[str, User] = {}
        for name, fields in raw.users.items():
            where = f"users.{name}"
            if name == RESERVED_NAME:
                raise ConfigError(where, name, f"a name other than {RESERVED_NAME!r} (reserved)")
            entry = _entry(where, fields)
            if entry.token_hash in by_hash:
                raise ConfigError(f"{where}.token_hash", "…", "a hash no other user has")
            quota = self.default_quota if entry.quota is None else entry.quota
            by_hash[entry.token_hash] = User(name=name, role=entry.role, quota=quota)
        return by_hash


class _Quotas(Mapping[str, int]):
    """The users' quotas, the file looked at again at most every :data:`_QUOTAS_CHECK_S`:
    the scheduler reads them for every waiting cell at every change."""

    def __init__(self, users: UsersFile) -> None:
        self._users = users
        self._quotas: dict[str, int] = {}
        self._checked = -math.inf

    def _now(self) -> dict[str, int]:
        if time.monotonic() - self._checked >= _QUOTAS_CHECK_S:
            self._quotas = {u.name: u.quota for u in self._users.users}
            self._checked = time.monotonic()
        return self._quotas

    def __getitem__(self, name: str) -> int:
        return self._now()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())


def _entry(where: str, fields: Mapping[str, Any]) -> _Entry:
    """One user's table, checked; errors name it (``users.NAME.KEY``)."""
    try:
        entry = convert_strictly(fields, _Entry)
    except ConfigError as exc:
        raise ConfigError(f"{where}.{exc.key}", exc.value, exc.expected) from None
    if not _HASH.fullmatch(entry.token_hash):
        raise ConfigError(f"{where}.token_hash", "…", "sha256: and 64 hex digits")
    return entry


def users_file_entry(name: str, token: str, role: Role = "user", quota: int | None = None) -> str:
    """The TOML table of one user for a users file (what ``nbos users add`` appends)."""
    # A quoted key: a name may hold dots.
    lines = [
        f"[users.{json.dumps(name)}]",
        f'token_hash = "{hash_token(token)}"',
        f'role = "{role}"',
    ]
    if quota is not None:
        lines.append(f"quota = {quota}")
    return "\n".join(lines) + "\n"
