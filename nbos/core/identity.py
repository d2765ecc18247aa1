"""Who makes a request: users, their roles and quotas, and the identity providers.

Every request to the gateway (HTTP, WebSocket, control endpoint, metrics) carries a token;
an :class:`IdentityProvider` says whose it is. nbos has two: a users file
(:class:`nbos.gateway.auth.UsersFile`) and JupyterHub (:class:`nbos.gateway.auth.HubUsers`);
the gateway asks them in turn. A kernel belongs to the user who started it; a user sees
only their own kernels, an ``admin`` sees all (``docs/users.md``).

Tokens are never stored in clear: a users file holds :func:`hash_token` of each. Tokens
are random (:func:`new_token`, 256 bits), so one round of SHA-256 is enough: there is no
password to guess from its hash.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Annotated, Literal, Protocol

import msgspec

#: ``admin``: sees and may act on every kernel, and on the cluster (chaos, shutdown).
Role = Literal["user", "admin"]

#: A user's guaranteed GPUs (committed to running cells at once); beyond it a user
#: borrows idle GPUs, which go first to users under their quota.
Quota = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]

#: User names as JupyterHub allows them, and no longer than a kernel id.
UserName = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[^\s/]+$")]

#: The prefix of the token hashes :func:`hash_token` makes (and the only one read).
HASH_SCHEME = "sha256:"


class User(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An authenticated user: a name, a role and a guaranteed GPU quota."""

    name: UserName
    role: Role = "user"
    quota: Quota = 0

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def may_see(self, owner: str) -> bool:
        """Whether this user may see (and act on) a kernel of ``owner``."""
        return self.is_admin or owner == self.name


class IdentityProvider(Protocol):
    """Says whose a token is.

    ``authenticate`` returns the :class:`User` a token belongs to, or ``None`` for a token
    the provider does not know; it raises
    :class:`~nbos.core.errors.IdentityProviderError` when it cannot tell now (its
    back end does not answer). It is asked on every request: cache what is slow.
    """

    async def authenticate(self, token: str) -> User | None: ...


def hash_token(token: str) -> str:
    """What a users file keeps of ``token``: ``sha256:`` and its hex digest."""
    return HASH_SCHEME + hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)
